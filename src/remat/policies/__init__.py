"""Checkpoint policies: how a layer's call runs, what it holds for backward, and what it costs. No torch
at import (`remat.config` and `remat.plan` use this package): the selective policy's torch side is
`_selective_ops`."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ..errors import PolicyError


@dataclass(frozen=True)
class LayerProfile:
    """What one layer was measured to hold and cost, per policy (`remat.planner`): `held[policy]` the
    (device, host) bytes held for backward, `seconds[policy]` the step time added over "none"."""

    index: int
    input_bytes: int
    held: dict[str, tuple[int, int]]
    seconds: dict[str, float]


@dataclass(frozen=True)
class Cost:
    """What a policy costs one layer: bytes held for backward (device, host) and seconds added."""

    device_bytes: int
    host_bytes: int
    seconds: float


@dataclass(frozen=True)
class Policy:
    """One way to pay for a layer's activations. `checkpointed`: activations are recomputed in backward
    (all but "none"); `input_on_host`: the saved input waits in host memory; `needs_non_reentrant`: torch
    supports the policy only in non-reentrant checkpointing."""

    name: str
    checkpointed: bool
    input_on_host: bool
    needs_non_reentrant: bool = False

    def checkpoint_options(self, index: int) -> dict[str, Any]:
        """Keyword arguments for `torch.utils.checkpoint.checkpoint` beyond the usual ones."""
        return {}

    def explain_recompute_error(self, error: RuntimeError, index: int) -> RuntimeError | None:
        """A clearer error for one torch raised recomputing layer `index`, or None to let torch's stand."""
        return None

    def cost(self, profile: LayerProfile) -> Cost:
        device, host = profile.held[self.name]
        return Cost(device, host, profile.seconds.get(self.name, 0.0))


class SelectivePolicy(Policy):
    """Op-level selective checkpointing inside the layer (Korthikanti et al., 2022): the outputs of
    its linear projections (the GEMMs nn.Linear and LoRA dispatch to) and of fused attention
    kernels are kept; the rest is recomputed in backward: norms, rotary embeddings, activations,
    dropout (its masks replayed from the RNG state, so gradients are exact), an eager attention's
    core (whose outputs grow with the square of the sequence length) and low-rank expansions such
    as LoRA's B. It holds more than "recompute" and far less than "none"."""

    def checkpoint_options(self, index: int) -> dict[str, Any]:
        # torch calls context_fn once per checkpointed call, for a fresh pair of contexts
        from ._selective_ops import fresh_contexts

        return {"context_fn": functools.partial(fresh_contexts, index)}

    def explain_recompute_error(self, error: RuntimeError, index: int) -> RuntimeError | None:
        from ..compat.transformers_compat import TORCH_SAC_MUTATED

        if TORCH_SAC_MUTATED not in str(error):
            return None
        return PolicyError(
            f"layer {index} changes, in place, the output of an op that the 'selective' policy keeps "
            f"(torch: {error}). The kept value is no longer the one backward needs; give this layer "
            f"another policy (layer_policies={{{index}: 'recompute'}})",
            layer=index,
        )


NONE = Policy("none", checkpointed=False, input_on_host=False)  # keeps its activations: fastest, holds the most
RECOMPUTE = Policy("recompute", checkpointed=True, input_on_host=False)  # keeps only its input, runs again
OFFLOAD = Policy("offload", checkpointed=True, input_on_host=True)  # "recompute", its input in host memory
SELECTIVE = SelectivePolicy("selective", checkpointed=True, input_on_host=False, needs_non_reentrant=True)

REGISTRY: dict[str, Policy] = {policy.name: policy for policy in (NONE, RECOMPUTE, OFFLOAD, SELECTIVE)}
NAMES = tuple(REGISTRY)
CHECKPOINTED = tuple(name for name, policy in REGISTRY.items() if policy.checkpointed)
CHECKPOINT_POLICIES = CHECKPOINTED
"""What `CheckpointConfig.checkpoint_policy` may choose for every checkpointed layer."""


def policy(name: str) -> Policy:
    return REGISTRY[name]


__all__ = ["CHECKPOINTED", "CHECKPOINT_POLICIES", "NAMES", "REGISTRY", "Cost", "LayerProfile", "Policy", "policy"]
