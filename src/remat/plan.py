"""The checkpoint map: a pure function of (config, layer names), installed as it is. The contract's
invariants live here, testable with no model: one policy per layer; a swapped layer is never "none"
(its weights are fetched for the recompute); every index the config names exists."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import overload

from .config import CheckpointConfig
from .errors import ConfigError
from .policies import CHECKPOINTED, NAMES
from .policies import policy as policy_named


@dataclass(frozen=True)
class LayerPlan:
    """What happens to one layer: its place in the stack, its name, its policy and why."""

    index: int
    name: str
    policy: str
    swapped: bool = False
    reason: str = ""

    @property
    def checkpointed(self) -> bool:
        return self.policy in CHECKPOINTED

    @property
    def offloaded(self) -> bool:
        """Its saved input waits in host memory."""
        return policy_named(self.policy).input_on_host


@dataclass(frozen=True)
class HeadPlan:
    """The map's head row (`remat.head`): the output embedding's name, "plain" or "chunked" (with its tokens per
    chunk), and why."""

    name: str
    policy: str
    chunk_tokens: int | None = None
    reason: str = ""

    @property
    def label(self) -> str:
        return head_label(self.policy, self.chunk_tokens)


def head_label(policy: str, chunk_tokens: int | None) -> str:
    """How a head is written in maps, plans and receipts: "plain" or "chunked(N)" (a config that leaves the chunk
    to remat: "chunked(remat's)")."""
    if policy != "chunked":
        return policy
    return f"chunked({chunk_tokens})" if chunk_tokens is not None else "chunked(remat's)"


@dataclass(frozen=True, repr=False)
class CheckpointMap(Sequence[LayerPlan]):
    """The per-layer plan, in layer order, and the head's row (`head`: not one of the items, whose
    policies are a layer's); `str()` renders a table. `off` says why none of it runs now (the wrapper
    is disabled): the plans stay what `enable()` applies again, and every rendering says that remat
    is off. Equality compares the plans and the head."""

    plans: Sequence[LayerPlan]
    off: str | None = field(default=None, kw_only=True, compare=False)
    head: HeadPlan | None = field(default=None, kw_only=True)  # the row after the layers (`remat.head`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plans", tuple(self.plans))
        for position, plan in enumerate(self.plans):
            if plan.index != position:
                raise ConfigError(f"layer plans must be in order: position {position} holds index {plan.index}")
            if plan.swapped and not plan.checkpointed:
                raise ConfigError(f"layer {plan.index} is swapped but not checkpointed")

    @overload
    def __getitem__(self, i: int) -> LayerPlan: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[LayerPlan]: ...
    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self.plans[i]

    def __len__(self) -> int:
        return len(self.plans)

    def indices(self, *policies: str) -> list[int]:
        """The layers whose policy is one of `policies`: `cm.checkpoint_map.indices("offload", "selective")`."""
        return [p.index for p in self.plans if p.policy in policies]

    @property
    def checkpointed(self) -> list[int]:
        """The layers run under a checkpoint (every policy but "none"), in order."""
        return [p.index for p in self.plans if p.checkpointed]

    def switched_off(self, why: str) -> CheckpointMap:
        return CheckpointMap(self.plans, off=why, head=self.head)

    def with_head(self, head: HeadPlan) -> CheckpointMap:
        return CheckpointMap(self.plans, off=self.off, head=head)

    def __repr__(self) -> str:
        # the classic three always (a log reader compares them), any other policy when used
        shown = [name for name in NAMES if name != "none" and (name in ("recompute", "offload") or self.indices(name))]
        shown.append("none")
        groups = ", ".join(f"{policy} {self.indices(policy)}" for policy in shown)
        swapped = [p.index for p in self.plans if p.swapped]
        off = f"; remat is OFF ({self.off}): nothing is checkpointed" if self.off else ""
        head = f", head {self.head.label}" if self.head is not None else ""
        return f"CheckpointMap({len(self)} layers: {groups}, swapped {swapped}{head}{off})"

    def __str__(self) -> str:
        from .display import map_table, off_notice

        table = map_table(self)
        return table if self.off is None else f"{off_notice(self.off)}\n{table}"


def swapped_indices(config: CheckpointConfig, num_layers: int) -> list[int]:
    """Which layers keep their weights in host memory. "spread" puts the k-th of n at the end of the k-th of n equal
    slices of the stack, so a prefetch has resident layers to hide behind; "tail" takes the last n."""
    if isinstance(config.swap_layers, tuple):
        if bad := [i for i in config.swap_layers if i >= num_layers]:
            raise ConfigError(
                f"swap_layers names layer(s) {bad}, but the model has {num_layers} layers: use 0..{num_layers - 1}"
            )
        return list(config.swap_layers)
    count = config.swap_layers
    if count > num_layers:
        raise ConfigError(f"swap_layers={count} asks for more layers than the model has ({num_layers}): ask for fewer")
    if config.swap_placement == "tail":
        return list(range(num_layers - count, num_layers))
    return [((k + 1) * num_layers) // count - 1 for k in range(count)]


def plan_layers(
    config: CheckpointConfig, layer_names: Sequence[str], *, checkpointing_off_by: str | None = None
) -> CheckpointMap:
    """The map for `config` over layers named `layer_names` (in module order). `checkpointing_off_by` names the route
    that turned checkpointing off (e.g. "gradient_checkpointing_disable()"): every layer not swapped is then "none"."""
    num_layers = len(layer_names)
    if num_layers == 0:
        raise ConfigError("there are no layers to plan")
    if (choices := getattr(config, "choices", None)) and len(choices) != num_layers:  # a PlannedConfig, profiled
        raise ConfigError(
            f"this plan was made from the profile of a model with {len(choices)} layers, but this one has "
            f"{num_layers}: profile this model, cm.profile(batch).plan(budget)"
        )
    if missing := [i for i in config.layer_policies if i >= num_layers]:
        raise ConfigError(
            f"layer_policies names layer(s) {missing}, but the model has {num_layers} layers: use 0..{num_layers - 1}"
        )
    swapped = set(swapped_indices(config, num_layers))
    n, checkpoint_policy = config.every_n_layers, config.checkpoint_policy
    plans = []
    for index, name in enumerate(layer_names):
        if checkpointing_off_by is not None:
            policy, reason = "none", f"turned off by {checkpointing_off_by}"
        elif index in config.layer_policies:
            policy, reason = config.layer_policies[index], f"layer_policies[{index}]"
        elif index % n == 0:
            policy, reason = checkpoint_policy, ("every layer" if n == 1 else f"every_n_layers={n}")
        else:
            policy, reason = "none", f"every_n_layers={n} skips it"
        if index in swapped and policy == "none":
            policy, reason = checkpoint_policy, f"swapped layers are always checkpointed ({reason})"
        plans.append(LayerPlan(index, name, policy, index in swapped, reason))
    return CheckpointMap(plans)
