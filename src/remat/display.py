"""Tables for people: the map, with offload and swap counters. `remat.plan` knows nothing of display."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain fixed-width table; the last column is left unpadded."""
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    lines = (header, tuple("-" * w for w in widths), *rows)
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in lines)


def mib(nbytes: float, digits: int = 2) -> str:
    """Bytes as MiB, the unit of every table and message: `mib(3 * 2**20)` is "3.00"."""
    return f"{nbytes / 2**20:.{digits}f}"


def off_notice(why: str) -> str:
    """The line shown above a map that is not running."""
    return (
        f"remat is OFF ({why}): no layer is checkpointed, offloaded or swapped. The plan below is kept; "
        "cm.enable() applies it again."
    )


def map_table(checkpoint_map: Sequence[Any]) -> str:
    rows = [(str(p.index), p.name, p.policy, "yes" if p.swapped else "no", p.reason) for p in checkpoint_map]
    return render_table(("index", "name", "policy", "swapped", "why"), [*rows, *_head_row(checkpoint_map, 5)])


def _head_row(checkpoint_map: Sequence[Any], width: int) -> list[tuple[str, ...]]:
    """The head's row after the layers: "head", its module's name, its policy; blanks up to the "why"."""
    head = getattr(checkpoint_map, "head", None)
    if head is None:
        return []
    return [("head", head.name, head.label, *("",) * (width - 4), head.reason)]


def describe_map(checkpoint_map: Sequence[Any], offload_stats: Mapping[int, Any], swap_stats: Mapping[int, Any]) -> str:
    """The map's table plus per-layer offload counters (bytes offloaded / kept and why, copies) and
    block swap ones (weight fetches and bytes fetched)."""
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
    rows += _head_row(checkpoint_map, 9)
    header = ("index", "name", "policy", "swapped", "offloaded MiB", "kept MiB", "copies out/in", "weight fetches")
    table = render_table((*header, "why"), rows)
    off = getattr(checkpoint_map, "off", None)
    return table if off is None else f"{off_notice(off)}\n{table}"
