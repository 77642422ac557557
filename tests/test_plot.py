"""`profile.plot()`: the frontier marks the budget and the map chosen for it, says its scope,
never draws a label over another, and says how to install matplotlib when it is missing."""

import sys

import pytest
from test_chooser import layer, measurements

from remat import CheckpointConfig
from remat.planner.profile import Profile

pytest.importorskip("matplotlib")
MIB = 2**20


@pytest.fixture
def profile():
    """A profile of two layers, hand-built as in test_chooser.py (what `cm.profile` returns; its
    measuring is tested in test_planner.py, which plots a measured profile too)."""
    layers = [layer(i, none=100 * MIB, recompute=10 * MIB, selective=40 * MIB) for i in range(2)]
    return Profile(measurements(layers, outside=(5 * MIB, 5 * MIB)), CheckpointConfig(), (), 0.0)


def _label_boxes(figure):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(figure).get_renderer()
    return [(text.get_text(), text.get_window_extent(renderer)) for text in figure.axes[0].texts]


def _assert_no_label_over_another(figure):
    boxes = _label_boxes(figure)
    for i, (label, box) in enumerate(boxes):
        for other, other_box in boxes[i + 1 :]:
            assert not box.overlaps(other_box), f"{label!r} is drawn over {other!r}"


def test_the_plot_marks_the_budget_and_the_plan_chosen_for_it_and_says_its_scope(profile):
    frontier = profile.frontier()
    budget = (frontier[0].predicted_device_bytes + frontier[-1].predicted_device_bytes) // 2
    planned = profile.plan(budget)
    figure = profile.plot(budget=budget)
    ax = figure.axes[0]
    assert "scope='activations'" in ax.get_title() and "held activations" in ax.get_title()
    assert f"budget {budget / MIB:.1f} MiB" in ax.get_title()
    (line,) = [line for line in ax.lines if line.get_label() == "budget"]
    assert line.get_xdata()[0] == pytest.approx(budget / MIB)
    (star,) = [c for c in ax.collections if c.get_label() == "chosen for the budget"]
    x, y = star.get_offsets()[0]
    assert (x, y) == pytest.approx((planned.predicted_device_bytes / MIB, planned.predicted_seconds * 1e3))
    assert any(t.get_text().startswith("chosen:") for t in ax.texts)
    assert {"remat: every undominated map", "native (transformers)", "budget", "chosen for the budget"} <= {
        t.get_text() for t in ax.get_legend().get_texts()
    }
    _assert_no_label_over_another(figure)

    plain = profile.plot()
    assert not [line for line in plain.axes[0].lines if line.get_label() == "budget"]
    assert "budget" not in plain.axes[0].get_title()


def test_a_budget_plan_refuses_is_refused_by_the_plot_and_one_nothing_fits_says_so(profile):
    for budget in (0, "0B", -1):
        with pytest.raises(ValueError, match="budget must be"):
            profile.plot(budget=budget)
    figure = profile.plot(budget=1)
    assert "(nothing fits)" in figure.axes[0].get_title()
    assert not [c for c in figure.axes[0].collections if c.get_label() == "chosen for the budget"]


def test_native_options_priced_alike_share_one_label_and_no_label_overprints_another(profile):
    # On two layers every_n_layers=2, 3 and 4 are one map (layer 0 recomputed): one mark, one label.
    figure = profile.plot(budget=profile.frontier()[0].predicted_device_bytes)
    texts = [t.get_text() for t in figure.axes[0].texts]
    assert "every_n_layers=2 = every_n_layers=3 = every_n_layers=4" in texts, texts
    assert "every_n_layers=1" in texts and "no checkpointing" in texts
    _assert_no_label_over_another(figure)


def test_labels_of_points_close_together_are_moved_apart():
    from remat.planner.plot import frontier_figure

    native = {f"every_n_layers={k}": (100 * MIB + k * 1024, 0.5 + k * 1e-6) for k in (1, 2, 3, 4)}
    figure = frontier_figure(
        [(100 * MIB, 0.5), (200 * MIB, 0.4)], native, scope="step", tokens=64, budget=150 * MIB, chosen=(100 * MIB, 0.5)
    )
    assert len(figure.axes[0].texts) == 5
    _assert_no_label_over_another(figure)
    assert (
        "scope='step'" in figure.axes[0].get_title() and "peak of a whole training step" in figure.axes[0].get_title()
    )


def test_without_matplotlib_the_error_names_the_plot_extra(profile, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # what `import` sees where it is not installed
    with pytest.raises(ImportError, match=r"remat\[plot\].*pip install"):
        profile.plot()
