"""What every checkpoint policy says about itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerProfile:
    """What one layer was measured to hold and cost, per policy (see `remat.planner`).

    `held[policy]` is (device bytes, host bytes) the layer holds for backward after forward
    under that policy; `seconds[policy]` the step time that policy adds over "none" for this
    layer. The input bytes are what a checkpointed layer keeps at the least.
    """

    index: int
    input_bytes: int
    held: dict[str, tuple[int, int]]
    seconds: dict[str, float]


@dataclass(frozen=True)
class Cost:
    """What a policy costs one layer: bytes held for backward on the device and in host
    memory, and seconds added to the step."""

    device_bytes: int
    host_bytes: int
    seconds: float


@dataclass(frozen=True)
class Policy:
    """One way to pay for a layer's activations.

    Attributes:
        name: the name in `layer_policies` and the map.
        checkpointed: the layer's activations are dropped after forward and recomputed in
            backward (its shim is installed); "none" is the only policy that is not.
        input_on_host: the layer's saved input waits for backward in host memory (else on the
            device).
        needs_non_reentrant: torch supports the policy only in non-reentrant checkpointing.
    """

    name: str
    checkpointed: bool
    input_on_host: bool
    needs_non_reentrant: bool = False

    def checkpoint_options(self, index: int) -> dict[str, Any]:
        """Keyword arguments for `torch.utils.checkpoint.checkpoint` beyond the usual ones, for
        layer `index`."""
        return {}

    def explain_recompute_error(self, error: RuntimeError, index: int) -> RuntimeError | None:
        """A clearer error for one torch raised while recomputing layer `index` under this
        policy, or None to let torch's stand."""
        return None

    def cost(self, profile: LayerProfile) -> Cost:
        """This policy's cost for the layer, from what was measured under it."""
        device, host = profile.held[self.name]
        return Cost(device, host, profile.seconds.get(self.name, 0.0))
