"""The checkpoint map: a pure function of (config, layer names).

Every invariant of the contract lives here, so it can be tested with no model at all:

- a swapped layer is never "none" (its weights are fetched for the recompute, so it must be
  checkpointed whatever `every_n_layers` or `layer_policies` say);
- each layer has exactly one policy, so no layer can be checkpointed twice;
- every index named by the config exists.

`CheckpointedModel` installs exactly what the map says, so the map is what runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

from .config import CheckpointConfig

CHECKPOINTED = ("recompute", "offload")


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


class CheckpointMap(Sequence[LayerPlan]):
    """The per-layer plan, in layer order. `str()` renders a table."""

    def __init__(self, plans: Sequence[LayerPlan]):
        self._plans = tuple(plans)
        for position, plan in enumerate(self._plans):
            if plan.index != position:
                raise ValueError(f"layer plans must be in order: position {position} holds index {plan.index}")
            if plan.swapped and not plan.checkpointed:
                raise ValueError(f"layer {plan.index} is swapped but not checkpointed")

    @overload
    def __getitem__(self, i: int) -> LayerPlan: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[LayerPlan]: ...
    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self._plans[i]

    def __len__(self) -> int:
        return len(self._plans)

    def __iter__(self) -> Iterator[LayerPlan]:
        return iter(self._plans)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CheckpointMap) and self._plans == other._plans

    def __hash__(self) -> int:
        return hash(self._plans)

    def indices(self, *policies: str) -> list[int]:
        """Indices of the layers whose policy is one of `policies`."""
        return [p.index for p in self._plans if p.policy in policies]

    @property
    def checkpointed(self) -> list[int]:
        return [p.index for p in self._plans if p.checkpointed]

    def __repr__(self) -> str:
        groups = ", ".join(f"{policy} {self.indices(policy)}" for policy in (*CHECKPOINTED, "none"))
        swapped = [p.index for p in self._plans if p.swapped]
        return f"CheckpointMap({len(self)} layers: {groups}, swapped {swapped})"

    def __str__(self) -> str:
        return render_table(
            ("index", "name", "policy", "swapped", "why"),
            [(str(p.index), p.name, p.policy, "yes" if p.swapped else "no", p.reason) for p in self._plans],
        )


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain fixed-width table; the last column is left unpadded."""
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    lines = []
    for row in (header, tuple("-" * w for w in widths), *rows):
        cells = [str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def swapped_indices(config: CheckpointConfig, num_layers: int) -> list[int]:
    """Which layers keep their weights in host memory.

    "spread" puts the k-th of n swapped layers at the end of the k-th of n equal slices of the
    stack, so swapped layers alternate with resident ones and a prefetch has compute to hide
    behind; "tail" takes the last n layers.
    """
    if isinstance(config.swap_layers, tuple):
        bad = [i for i in config.swap_layers if i >= num_layers]
        if bad:
            raise ValueError(
                f"swap_layers names layer(s) {bad}, but the model has {num_layers} layers (0..{num_layers - 1})"
            )
        return list(config.swap_layers)
    count = config.swap_layers
    if count > num_layers:
        raise ValueError(f"swap_layers={count} asks for more layers than the model has ({num_layers})")
    if count == 0:
        return []
    if config.swap_placement == "tail":
        return list(range(num_layers - count, num_layers))
    return [((k + 1) * num_layers) // count - 1 for k in range(count)]


def plan_layers(
    config: CheckpointConfig,
    layer_names: Sequence[str],
    *,
    checkpointing_off_by: str | None = None,
) -> CheckpointMap:
    """The map for `config` over layers named `layer_names` (in module order).

    `checkpointing_off_by` names the route that turned checkpointing off (for example
    "gradient_checkpointing_disable()"): every layer that is not swapped becomes "none".
    """
    num_layers = len(layer_names)
    if num_layers == 0:
        raise ValueError("there are no layers to plan")
    missing = [i for i in config.layer_policies if i >= num_layers]
    if missing:
        raise ValueError(
            f"layer_policies names layer(s) {missing}, but the model has {num_layers} layers (0..{num_layers - 1})"
        )
    swapped = set(swapped_indices(config, num_layers))
    checkpoint_policy = "offload" if config.offload else "recompute"
    n = config.every_n_layers

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
        if policy == "offload" and reason.startswith("every"):
            reason += ", offload=True"
        plans.append(LayerPlan(index, name, policy, index in swapped, reason))
    return CheckpointMap(plans)


def describe_map(
    checkpoint_map: CheckpointMap, offload_stats: Mapping[int, Any], swap_stats: Mapping[int, Any] | None = None
) -> str:
    """The map's table plus per-layer counters: offload (bytes offloaded / kept and why, copies)
    and block swap (weight fetches and bytes fetched)."""
    mib = lambda b: f"{b / 2**20:.2f}"
    swap_stats = swap_stats or {}
    rows = []
    for p in checkpoint_map:
        stats = offload_stats.get(p.index)
        if stats is None:
            moved = kept = copies = why = ""
        else:
            moved, kept = mib(stats.offloaded_bytes), mib(stats.kept_bytes)
            copies = f"{stats.copies_to_host}/{stats.copies_to_device}"
            why = "; ".join(stats.kept_because)
        swap = swap_stats.get(p.index)
        fetched = f"{swap.fetches} ({mib(swap.bytes_fetched)} MiB)" if swap is not None else ""
        swapped = "yes" if p.swapped else "no"
        rows.append((str(p.index), p.name, p.policy, swapped, moved, kept, copies, fetched, why or p.reason))
    header = ("index", "name", "policy", "swapped", "offloaded MiB", "kept MiB", "copies out/in", "weight fetches")
    header += ("why",)
    return render_table(header, rows)
