"""`profile.plot()`: the frontier as a matplotlib Figure (matplotlib is imported only here)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def frontier_figure(
    points: Sequence[tuple[float, float]],
    native: Mapping[str, tuple[float, float]],
    *,
    scope: str,
    tokens: int,
) -> Any:
    """Predicted step time against predicted bytes: the planner's undominated maps as a staircase
    (a budget between two of them gets the one below), transformers' native options as marks."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.5, 4.8))
    ax = figure.add_subplot()
    xs = [b / 2**20 for b, _ in points]
    ys = [s * 1e3 for _, s in points]
    if xs:
        ax.step(xs, ys, where="post", color="#3a78b5", alpha=0.5, linewidth=1)
        ax.scatter(xs, ys, color="#3a78b5", marker="o", s=14, label="remat: every undominated map", zorder=3)
    for i, (label, (nbytes, seconds)) in enumerate(sorted(native.items(), key=lambda item: item[1][0])):
        x, y = nbytes / 2**20, seconds * 1e3
        ax.scatter([x], [y], color="#d08c40", marker="s", zorder=4, label="native (transformers)" if i == 0 else None)
        ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    what = "held activations" if scope == "activations" else "peak of a whole training step"
    ax.set(xlabel=f"predicted MiB ({what})", ylabel="predicted step ms", title=f"remat plans for {tokens} tokens")
    ax.legend(fontsize=8)
    figure.tight_layout()
    return figure
