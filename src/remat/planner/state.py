"""`ModelState`: what a profile's bytes and seconds per layer depend on, recorded when measured. A plan for a model
changed since (cast, moved, another trainable parameter, adapter, swap set, head, attention or checkpoint
implementation) is refused, naming the change (`StaleProfileError`): a float32 profile planned a float64 model at
half its bytes, swapped weights hold device slots across a step, a head changed after profiling moves the bytes
outside the layers (a plan for a plain head's profile, run with a chunked head, was 2.3x off), and eager attention
holds its scores (a plan for SDPA's profile held 15% more under eager)."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..plan import head_label, swapped_indices

Counts = tuple[tuple[str, int], ...]
Shapes = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class ModelState:
    """What a profile's figures depend on, as it was when measured."""

    dtypes: Counts  # (dtype, number of parameters of it)
    devices: Counts  # (device, number of parameters on it)
    trainable: Shapes  # (name, shape) of every parameter that requires grad
    adapters: tuple[str, ...]  # the model's PEFT adapters (empty without PEFT)
    active_adapters: tuple[str, ...]
    swapped: tuple[int, ...]  # the layers whose frozen weights rest in host memory
    offload_min_bytes: int  # the config's: an offloaded input under it stays on the device
    use_reentrant: bool
    head: tuple[str, int | None] | None = None  # the config's (head, head_chunk_tokens); None: not recorded
    attention: str | None = None  # the model's attention implementation (eager holds its scores); None: not recorded
    # a digest of every frozen parameter's name and shape (the list itself: 2.3 MB in each save of a 19k-parameter
    # MoE): a resized embedding and head (chat tokens added under LoRA) change the logits' bytes, the largest
    # activation, with no dtype, device or trainable parameter changed; None: not recorded
    frozen: str | None = None

    @classmethod
    def of(cls, model: nn.Module, config: Any, num_layers: int) -> ModelState:
        params = list(model.named_parameters())
        adapters, active = adapters_of(model)
        return cls(
            dtypes=_counts(str(p.dtype).removeprefix("torch.") for _, p in params),
            devices=_counts(str(p.device) for _, p in params),
            trainable=tuple((name, tuple(p.shape)) for name, p in params if p.requires_grad),
            adapters=adapters,
            active_adapters=active,
            swapped=tuple(swapped_indices(config, num_layers)),
            offload_min_bytes=config.offload_min_bytes,
            use_reentrant=config.use_reentrant,
            head=(config.head, config.head_chunk_tokens),
            attention=attention_of(model),
            frozen=_digest((name, tuple(p.shape)) for name, p in params if not p.requires_grad),
        )

    def changes(self, now: ModelState, *, measured_offload: bool, plans_head: bool = False) -> list[str]:
        """What differs in `now`, in words (empty: the same state). `offload_min_bytes` counts only
        when the profile measured offload (on a CPU nothing is offloaded, whatever the threshold); the head
        only when the profile does not choose it (`plans_head`: its plans name their head whatever the config's)."""
        found = []
        before_count, now_count = sum(n for _, n in self.dtypes), sum(n for _, n in now.dtypes)
        if before_count != now_count:  # parameters added or removed: compare which dtypes and devices, not counts
            found.append(f"the model had {before_count} parameters, now {now_count}")
        for what, old, new in (("dtypes", self.dtypes, now.dtypes), ("devices", self.devices, now.devices)):
            if (old != new) if before_count == now_count else (dict(old).keys() != dict(new).keys()):
                found.append(f"parameter {what} were {_listed(old)}, now {_listed(new)}")
        if self.trainable != now.trainable:
            found.append(_shapes_change("trainable", self.trainable, now.trainable))
        if not found and None not in (self.frozen, now.frozen) and self.frozen != now.frozen:
            found.append("frozen parameters changed in name or shape (resized embeddings: resize_token_embeddings?)")
        if self.adapters != now.adapters:
            found.append(f"adapters were {list(self.adapters)}, now {list(now.adapters)}")
        elif self.active_adapters != now.active_adapters:
            found.append(f"active adapters were {list(self.active_adapters)}, now {list(now.active_adapters)}")
        if self.swapped != now.swapped:
            found.append(f"the swapped layers were {list(self.swapped)}, now {list(now.swapped)}")
        if self.use_reentrant != now.use_reentrant:
            found.append(f"use_reentrant was {self.use_reentrant}, now {now.use_reentrant}")
        if not plans_head and None not in (self.head, now.head) and self.head != now.head:
            was, is_ = (head_label(*head) for head in (self.head, now.head))  # type: ignore[misc]
            found.append(f"the head was {was}, now {is_} (the bytes outside the layers were measured with the first)")
        if None not in (self.attention, now.attention) and self.attention != now.attention:
            found.append(f"the attention implementation was {self.attention!r}, now {now.attention!r}")
        if measured_offload and self.offload_min_bytes != now.offload_min_bytes:
            found.append(f"offload_min_bytes was {self.offload_min_bytes}, now {now.offload_min_bytes}")
        return found


def attention_of(model: nn.Module) -> str | None:
    """The attention implementation the model runs, with its sub-configs' (a VLM's text model may run eager alone):
    "sdpa", or "sdpa;text_config=eager;vision_config=sdpa"; None when the model has no transformers config."""
    config = getattr(model, "config", None)
    top = getattr(config, "_attn_implementation", None)
    names = sorted(getattr(config, "sub_configs", None) or {})
    subs = [f"{name}={getattr(getattr(config, name, None), '_attn_implementation', None)}" for name in names]
    return None if top is None and not subs else ";".join([str(top), *subs])


def _digest(shapes: Any) -> str:
    return hashlib.sha256(repr(list(shapes)).encode()).hexdigest()[:32]


def _counts(values: Any) -> Counts:
    return tuple(sorted(Counter(values).items()))


def _listed(counts: Counts) -> str:
    return ", ".join(f"{name} ({n} parameters)" for name, n in counts) or "none"


def _shapes_change(what: str, before: Shapes, now: Shapes) -> str:
    old, new = dict(before), dict(now)
    added = [name for name in new if name not in old]
    gone = [name for name in old if name not in new]
    reshaped = [name for name in new if name in old and new[name] != old[name]]
    parts = [f"{len(added)} more {what} (e.g. {added[0]})"] if added else []
    parts += [f"{len(gone)} no longer {what} (e.g. {gone[0]})"] if gone else []
    if reshaped:
        name = reshaped[0]
        parts.append(f"{len(reshaped)} with another shape (e.g. {name}: {list(old[name])} -> {list(new[name])})")
    return f"{what} parameters changed: " + "; ".join(parts or ["their order"])


def adapters_of(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The PEFT adapters of `model` and the active ones: a PeftModel's, or those transformers' own
    integration loaded into a plain model (duck typing: no PEFT import)."""
    if not isinstance(configs := getattr(model, "peft_config", None), dict) or not configs:
        return (), ()
    active: Any = getattr(model, "active_adapters", ())
    try:
        active = active() if callable(active) else active  # transformers' mixin: a method; PEFT: a property
    except Exception:  # transformers raises when no adapter is loaded
        active = ()
    if isinstance(active, str):
        active = [active]
    return tuple(sorted(configs)), tuple(sorted(str(name) for name in active or ()))
