"""`profile.plot()`: the frontier as a matplotlib Figure (matplotlib, the optional `plot` extra, is
imported only here)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_SCOPE_WORDS = {"activations": "held activations", "step": "peak of a whole training step"}
_MIB = 2**20
Point = tuple[float, float]  # (bytes, seconds)


def frontier_figure(
    points: list[Point], marks: dict[str, Point], *, scope: str, tokens: int, budget: int | None, chosen: Point | None
) -> Any:
    """Predicted step time against predicted bytes (of `scope`, said in the title): the undominated maps as a staircase
    (a budget between two gets the one below), transformers' native options as marks, and a `budget` as a vertical line
    with the map `chosen` for it (bytes, seconds) as a star. No label is drawn over another."""
    try:
        from matplotlib.figure import Figure
    except ImportError as missing:
        raise ImportError(
            "profile.plot() draws with matplotlib, which is not installed here. Install remat's plot extra, remat[plot]"
            " (pip install '.[plot]' in a clone of remat), or matplotlib itself: pip install 'matplotlib>=3.8'"
        ) from missing
    figure = Figure(figsize=(7.5, 4.8))
    ax = figure.add_subplot()
    xs, ys = [b / _MIB for b, _ in points], [s * 1e3 for _, s in points]
    if xs:
        ax.step(xs, ys, where="post", color="#3a78b5", alpha=0.5, linewidth=1)
        ax.scatter(xs, ys, color="#3a78b5", marker="o", s=14, label="remat: every undominated map", zorder=3)
    labels = []
    for i, (label, (x, y)) in enumerate(_merge_coinciding(marks)):
        ax.scatter([x], [y], color="#d08c40", marker="s", zorder=4, label="native (transformers)" if i == 0 else None)
        labels.append(ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points"))
    if budget is not None:
        ax.axvline(budget / _MIB, color="#b03a2e", linestyle="--", linewidth=1, label="budget")
        if chosen is not None:
            x, y = chosen[0] / _MIB, chosen[1] * 1e3
            ax.scatter([x], [y], color="#b03a2e", marker="*", s=120, zorder=5, label="chosen for the budget")
            text = f"chosen: {x:.1f} MiB, {y:.0f} ms"
            labels.append(
                ax.annotate(text, (x, y), fontsize=7, xytext=(3, -10), textcoords="offset points", color="#b03a2e")
            )
    what = _SCOPE_WORDS.get(scope, scope)
    within = "" if budget is None else f", budget {budget / _MIB:.1f} MiB" + ("" if chosen else " (nothing fits)")
    title = f"remat plans for {tokens} tokens{within}\nscope={scope!r}: bytes are the {what}"
    ax.set(xlabel=f"predicted MiB ({what})", ylabel="predicted step ms", title=title)
    ax.legend(fontsize=8)
    figure.tight_layout()
    _separate(figure, ax, labels)
    return figure


def _merge_coinciding(native: Mapping[str, Point]) -> list[tuple[str, Point]]:
    """Native options priced alike (every_n_layers=3 and =4 on a short stack are one map) as one
    mark with one label, in MiB and ms, ascending in bytes."""
    merged: dict[tuple[float, float], list[str]] = {}
    for label, (nbytes, seconds) in sorted(native.items(), key=lambda item: item[1][0]):
        merged.setdefault((round(nbytes / _MIB, 6), round(seconds * 1e3, 6)), []).append(label)
    return [(" = ".join(names), point) for point, names in merged.items()]


def _separate(figure: Any, ax: Any, labels: list[Any]) -> None:
    """Near the right edge a label reads leftwards, to stay inside; then each moves up, a step of its
    own height at a time, until it overlaps no label before it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer, (left, right) = FigureCanvasAgg(figure).get_renderer(), ax.get_xlim()
    placed = []
    for label in labels:
        if label.xy[0] > left + 0.8 * (right - left):
            label.set_horizontalalignment("right")
            label.xyann = (-label.xyann[0], label.xyann[1])
        for _ in range(50):
            box = label.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed):
                break
            label.xyann = (label.xyann[0], label.xyann[1] + box.height * 72 / figure.dpi + 1)
        placed.append(label.get_window_extent(renderer))
