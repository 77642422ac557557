"""`ModelState`: the state of a model that a profile's measurements hold for, recorded when it
is measured and compared each time a plan is chosen from it.

Bytes and seconds per layer are properties of one model state: parameters cast to float64
hold twice the bytes, a model moved to another device holds them elsewhere, a new trainable
parameter or adapter keeps activations for its own gradients, another `use_reentrant` is
another checkpoint. A plan chosen from a profile of another state would predict figures the
model no longer has, silently (a profile taken in float32 planned a float64 model at half
its bytes). So a `Profile` records the state it measured, and planning from it refuses
(`StaleProfileError`) when the model's current state differs, naming what changed.

The swapped layers count as state too: block swap holds device slots for the swapped layers'
weights across a step, which the step's held bytes include (on a 4-layer tiny Llama, swapping
2 layers adds their frozen weights, 31% of the held bytes of one plan), and a swapped layer may
not go without checkpointing. So a plan for another swap set is refused like the rest: profile
again with the swap set enabled, and the plan keeps it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..plan import swapped_indices


@dataclass(frozen=True)
class ModelState:
    """What a profile's figures depend on, as it was when measured.

    Attributes:
        dtypes: (dtype, number of parameters of it), one entry per dtype.
        devices: (device, number of parameters on it), one entry per device.
        trainable: (name, shape) of every parameter that requires grad.
        adapters: the names of the model's PEFT adapters (empty without PEFT).
        active_adapters: the ones active.
        swapped: the indices of the layers whose frozen weights rest in host memory.
        offload_min_bytes: the config's threshold under which an offloaded input stays on the device.
        use_reentrant: the config's checkpoint implementation.
    """

    dtypes: tuple[tuple[str, int], ...]
    devices: tuple[tuple[str, int], ...]
    trainable: tuple[tuple[str, tuple[int, ...]], ...]
    adapters: tuple[str, ...]
    active_adapters: tuple[str, ...]
    swapped: tuple[int, ...]
    offload_min_bytes: int
    use_reentrant: bool

    @classmethod
    def of(cls, model: nn.Module, config: Any, num_layers: int) -> ModelState:
        """The state of `model` under `config` (a `CheckpointConfig`) with `num_layers` layers."""
        params = list(model.named_parameters())
        adapters, active = _adapters(model)
        return cls(
            dtypes=_counts(str(p.dtype).removeprefix("torch.") for _, p in params),
            devices=_counts(str(p.device) for _, p in params),
            trainable=tuple((name, tuple(p.shape)) for name, p in params if p.requires_grad),
            adapters=adapters,
            active_adapters=active,
            swapped=tuple(swapped_indices(config, num_layers)),
            offload_min_bytes=config.offload_min_bytes,
            use_reentrant=config.use_reentrant,
        )

    def changes(self, now: ModelState, *, measured_offload: bool) -> list[str]:
        """What differs in `now`, in words (empty: the same state). A change of
        `offload_min_bytes` counts only when the profile measured the offload policy (on a CPU
        nothing is offloaded, whatever the threshold)."""
        found = []
        before_count, now_count = sum(n for _, n in self.dtypes), sum(n for _, n in now.dtypes)
        if before_count != now_count:  # parameters added or removed: compare which dtypes and devices, not counts
            found.append(f"the model had {before_count} parameters, now {now_count}")
        for what, old, new in (("dtypes", self.dtypes, now.dtypes), ("devices", self.devices, now.devices)):
            differs = old != new if before_count == now_count else dict(old).keys() != dict(new).keys()
            if differs:
                found.append(f"parameter {what} were {_listed(old)}, now {_listed(new)}")
        if self.trainable != now.trainable:
            found.append(_trainable_change(self.trainable, now.trainable))
        if self.adapters != now.adapters:
            found.append(f"adapters were {list(self.adapters)}, now {list(now.adapters)}")
        elif self.active_adapters != now.active_adapters:
            found.append(f"active adapters were {list(self.active_adapters)}, now {list(now.active_adapters)}")
        if self.swapped != now.swapped:
            found.append(f"the swapped layers were {list(self.swapped)}, now {list(now.swapped)}")
        if self.use_reentrant != now.use_reentrant:
            found.append(f"use_reentrant was {self.use_reentrant}, now {now.use_reentrant}")
        if measured_offload and self.offload_min_bytes != now.offload_min_bytes:
            found.append(f"offload_min_bytes was {self.offload_min_bytes}, now {now.offload_min_bytes}")
        return found


def _counts(values: Any) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(Counter(values).items()))


def _listed(counts: tuple[tuple[str, int], ...]) -> str:
    return ", ".join(f"{name} ({n} parameters)" for name, n in counts) or "none"


def _trainable_change(
    before: tuple[tuple[str, tuple[int, ...]], ...], now: tuple[tuple[str, tuple[int, ...]], ...]
) -> str:
    old, new = dict(before), dict(now)
    parts = []
    added = [name for name in new if name not in old]
    gone = [name for name in old if name not in new]
    reshaped = [name for name in new if name in old and new[name] != old[name]]
    if added:
        parts.append(f"{len(added)} more trainable (e.g. {added[0]})")
    if gone:
        parts.append(f"{len(gone)} no longer trainable (e.g. {gone[0]})")
    if reshaped:
        name = reshaped[0]
        parts.append(f"{len(reshaped)} with another shape (e.g. {name}: {list(old[name])} -> {list(new[name])})")
    return "trainable parameters changed: " + "; ".join(parts or ["their order"])


def _adapters(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The PEFT adapters of `model` and the active ones: a PeftModel's, or those transformers'
    own PEFT integration loaded into a plain model (read by duck typing: no PEFT import)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return (), ()
    active: Any = getattr(model, "active_adapters", ())
    try:
        active = active() if callable(active) else active  # transformers' mixin: a method; PEFT: a property
    except Exception:  # transformers raises when no adapter is loaded
        active = ()
    if isinstance(active, str):
        active = [active]
    return tuple(sorted(configs)), tuple(sorted(str(name) for name in active or ()))
