"""`Profile`: what `cm.profile(batch)` measured, and the plans chosen from it without running
the model; `PlannedConfig`: a plan as a `CheckpointConfig` that remembers its prediction."""

from __future__ import annotations

from typing import Any

from ..arguments import parse_bytes, parse_count
from ..config import CheckpointConfig
from ..display import mib, render_table
from ..errors import ConfigError, StaleProfileError
from ..head import plan_head
from ..plan import head_label
from ..refs import LocalRef
from .chooser import LayerChoice, Measurements, Plan, check_scope, choose, frontier, native_points, smallest
from .peak import NO_OPTIMIZER_NOTE
from .state import ModelState

_MIB = 2**20
Size = int | str  # bytes, or a size like "6GiB"


class PlannedConfig(CheckpointConfig):
    """A `CheckpointConfig` (equal to, saved and loaded like, the plain one with the same fields)
    that remembers its prediction; `str()` shows it."""

    choices: tuple[LayerChoice, ...]
    outside_bytes: int
    planned_budget: int  # the bytes it was planned for (a config's `budget` is what plans it by itself)
    scope: str
    tokens: int
    predicted_seconds: float
    predicted_seconds_range: tuple[float, float] | None  # quartiles of the timing: the prediction's spread
    predicted_peak_bytes: int | None  # the peak of one whole step, when the profile measured it
    notes: tuple[str, ...]
    head_shown: str | None  # the head as the map shows it on the profiled model (None: the model is gone)

    @classmethod
    def of(cls, config: CheckpointConfig, **prediction: Any) -> PlannedConfig:
        if unknown := prediction.keys() - PlannedConfig.__annotations__.keys():
            raise TypeError(f"PlannedConfig has no prediction field(s) {sorted(unknown)}")
        planned = cls(**{name: getattr(config, name) for name in config.to_dict()})
        for key, value in prediction.items():
            object.__setattr__(planned, key, value)
        return planned

    def __getattr__(self, name: str) -> Any:
        """Only for a prediction field it lacks: one made by `dataclasses.replace`, from the fields alone."""
        if name in PlannedConfig.__annotations__ or isinstance(getattr(PlannedConfig, name, None), property):
            raise AttributeError(
                f"this PlannedConfig has no {name}: it was made from the config's fields alone (dataclasses.replace, "
                "from_dict or the constructor); "
                "planned.replace(...) gives the plain CheckpointConfig a changed plan is"
            )
        raise AttributeError(f"'PlannedConfig' object has no attribute {name!r}")

    @property
    def predicted_device_bytes(self) -> int:
        """Activations held for backward on the device, in the layers and outside them."""
        return self.outside_bytes + sum(c.device_bytes for c in self.choices)

    @property
    def predicted_host_bytes(self) -> int:
        return sum(c.host_bytes for c in self.choices)

    def __str__(self) -> str:
        rows = [
            (str(c.index), c.name, c.policy, mib(c.device_bytes), mib(c.host_bytes), f"{c.seconds * 1e3:+.1f}")
            for c in self.choices
        ]
        head = self.head_shown or head_label(self.head, self.head_chunk_tokens)
        rows.append(("", f"outside layers (head {head})", "", mib(self.outside_bytes), "0.00", ""))
        totals = (mib(self.predicted_device_bytes), mib(self.predicted_host_bytes))
        step = f"{self.predicted_seconds * 1e3:.1f} per step"
        if self.predicted_seconds_range is not None:
            step += " ({:.0f}-{:.0f})".format(*(s * 1e3 for s in self.predicted_seconds_range))
        rows.append(("", "total (predicted)", "", *totals, step))
        header = ("index", "name", "policy", "held MiB (device)", "held MiB (host)", "step ms")
        what = "held activations on the device" if self.scope == "activations" else "peak of a whole training step"
        lines = [
            render_table(header, rows),
            f"budget {mib(self.planned_budget)} MiB of {what}, for {self.tokens} tokens",
        ]
        if self.predicted_peak_bytes is not None:
            lines.append(f"predicted peak of a whole step: {mib(self.predicted_peak_bytes)} MiB")
        return "\n".join([*lines, *self.notes])


class Profile:
    """What one `cm.profile(batch)` measured: plans for any budget are chosen from it at once, running nothing.

    Plans are chosen for the wrapper as it is when `plan`, `frontier` or `plot` is called: they raise
    `StaleProfileError` (a ValueError) naming what changed when the model is no longer in the state measured (`state`:
    dtypes, devices, trainable parameters, adapters, swapped layers, the settings that change a measurement), and each
    plan is the wrapper's current config with only the per-layer policies chosen, so applying it keeps every other
    setting made since.

    Attributes:
        measurements: the per-layer bytes and seconds per policy (`remat.planner.chooser`).
        config: the config the profile was measured under.
        state: the model's state when measured (`remat.planner.state.ModelState`); None when unknown (a profile built
            by hand), which plans on `config` unchecked.
        notes: what the measuring could not do, or did differently (shown with each plan).
        profiling_seconds: how long the measuring took.
        native_every_n: the `every_n_layers` transformers' own enable offers on this version (marked by `plot`).
    """

    def __init__(
        self,
        measurements: Measurements,
        config: CheckpointConfig,
        notes: tuple[str, ...],
        profiling_seconds: float,
        native_every_n: tuple[int, ...] = (1, 2, 3, 4),
        *,
        state: ModelState | None = None,
        wrapper: Any = None,
    ):
        self.native_every_n = native_every_n
        self.measurements = measurements
        self.config = config
        self.notes = notes
        self.profiling_seconds = profiling_seconds
        self.state = state
        self._wrapper = _WeakSource(wrapper)

    @property
    def tokens(self) -> int:
        """Batch x sequence length of the profiled batch."""
        return self.measurements.tokens

    def plan(
        self, budget: Size, *, scope: str = "activations", tokens: int | None = None, length: int | None = None
    ) -> PlannedConfig:
        """The fastest map whose bytes fit `budget` (bytes, or a size like "6GiB"): held
        activations for `scope="activations"`, the peak of one whole training step for
        `scope="step"`; for a batch of `tokens` tokens (default: the profiled batch's) in rows of up to
        `length` (default: as many rows as the profiled batch's; longer rows hold more of what grows with
        the square of the length). Runs nothing. Raises ValueError naming the smallest budget that fits
        when none does."""
        limit = _budget_bytes(budget)
        config, m = self._base(scope, tokens, length)
        chosen = choose(m, limit, scope)
        if chosen is None:
            least = smallest(m, scope)
            what = "outside the layers (embeddings, logits, loss)"
            fixed = m.outside.checkpointing
            if scope == "step" and m.step is not None:
                state = "" if NO_OPTIMIZER_NOTE in self.notes else ", optimizer state"
                what = f"outside the layers and for weights, gradients{state} and backward's temporaries"
                fixed += min(m.step.extras.values())
            raise ConfigError(
                f"no map fits a budget of {limit} bytes ({limit / _MIB:.1f} MiB) for this model and batch: the "
                f"smallest is {int(least)} bytes ({least / _MIB:.1f} MiB), about {fixed / _MIB:.1f} MiB of it "
                f"{what}, which no checkpointing policy changes: give at least that"
            )
        return self._config(chosen, limit, m.tokens, config)

    def frontier(
        self, *, scope: str = "activations", tokens: int | None = None, length: int | None = None
    ) -> list[PlannedConfig]:
        """Every undominated plan: ascending in predicted bytes (of `scope`), each predicted faster
        than the one before (`tokens` and `length` as for `plan`). Each is a `PlannedConfig` whose
        `planned_budget` is its own predicted bytes."""
        config, m = self._base(scope, tokens, length)
        return [self._config(p, p.device_bytes, m.tokens, config) for p in frontier(m, scope)]

    def plot(
        self,
        *,
        scope: str = "activations",
        tokens: int | None = None,
        length: int | None = None,
        native: bool = True,
        budget: Size | None = None,
    ) -> Any:
        """A matplotlib Figure of the frontier: predicted step time against predicted bytes (of `scope`, said in the
        title), with transformers' native options (`every_n_layers` 1..4, and no checkpointing) marked where this
        profile can price them and this transformers offers them (`native=False` leaves them out). Given a `budget`
        (bytes or a size like "6GiB"), the budget is a vertical line and the map `plan(budget)` chooses a star. Needs
        matplotlib (the `plot` extra); without it, an ImportError says how to install it. `tokens` and `length` as
        for `plan`."""
        from .plot import frontier_figure

        _, m = self._base(scope, tokens, length)
        points = [(p.device_bytes, p.seconds) for p in frontier(m, scope)]
        marks = native_points(m, scope, self.native_every_n) if native else {}
        limit = None if budget is None else _budget_bytes(budget)
        best = None if limit is None else choose(m, limit, scope)
        chosen = None if best is None else (best.device_bytes, best.seconds)
        return frontier_figure(points, marks, scope=scope, tokens=m.tokens, budget=limit, chosen=chosen)

    def _base(self, scope: str, tokens: int | None, length: int | None = None) -> tuple[CheckpointConfig, Measurements]:
        """The wrapper's current config (the one measured under when it is gone or the state is
        unknown; `StaleProfileError` if the model changed) and the measurements at `tokens` and `length`."""
        check_scope(self.measurements, scope)  # a scope this profile cannot plan is said first
        if length is not None:
            length = parse_count(length, "length", "the longest row's tokens")
        m = self.measurements.scaled(tokens, length)
        controller, changes = self.changes()
        if changes:
            raise StaleProfileError(
                f"this profile measured the model in another state: {'; '.join(changes)}. Its figures do not hold for "
                "the model as it is now: call cm.profile(batch) again and plan from the new profile"
            )
        return (self.config if controller is None else controller.config), m

    def changes(self) -> tuple[Any, list[str]]:
        """The wrapper's controller (None: gone, or the state unknown) and what changed in its model since the
        measuring, in words (empty: nothing)."""
        controller = self._wrapper()
        try:
            model = None if controller is None else controller.model
        except RuntimeError:  # the model is gone
            model = None
        if model is None or self.state is None:
            return None, []
        names = tuple(plan.name for plan in controller.checkpoint_map)
        now = ModelState.of(model, controller.config, len(names))
        measured_offload = any("offload" in options for options in self.measurements.options)
        plans_head = self.measurements.head is not None
        changes = self.state.changes(now, measured_offload=measured_offload, plans_head=plans_head)
        if names != self.measurements.names:
            changes.insert(0, f"the layers were {list(self.measurements.names)}, now {list(names)}")
        return controller, changes

    def _config(self, chosen: Plan, budget: int, tokens: int, config: CheckpointConfig) -> PlannedConfig:
        picked = chosen.head
        head = {} if picked is None else {"head": picked.policy, "head_chunk_tokens": picked.chunk_tokens}
        planned = config.replace(budget=None, layer_policies={c.index: c.policy for c in chosen.choices}, **head)
        return PlannedConfig.of(
            planned,
            choices=chosen.choices,
            outside_bytes=chosen.outside_bytes,
            planned_budget=budget,
            scope=chosen.scope,
            tokens=tokens,
            predicted_seconds=chosen.seconds,
            predicted_seconds_range=chosen.seconds_range,
            predicted_peak_bytes=chosen.peak_bytes,
            notes=self.notes,
            head_shown=self._head_shown(planned),
        )

    def _head_shown(self, planned: CheckpointConfig) -> str | None:
        """The map's head row for the plan on the profiled model: a model without an output embedding shows
        "plain" and why, not the config's "chunked"."""
        controller = self._wrapper()
        try:
            model = None if controller is None else controller.model
        except RuntimeError:  # the model is gone
            return None
        if model is None:
            return None
        row = plan_head(planned.head, planned.head_chunk_tokens, model)
        return row.label if row.policy == planned.head else f"{row.label}: {row.reason}"

    def __repr__(self) -> str:
        return (
            f"Profile({len(self.measurements.layers)} layers, {self.tokens} tokens, "
            f"step {'measured' if self.measurements.step else 'not measured'}, {self.profiling_seconds:.1f} s)"
        )


def _budget_bytes(budget: Size) -> int:
    """A budget in bytes, for `plan` and `plot` alike (`plot(budget=0)` drew a line that `plan(0)` refused)."""
    return parse_bytes(budget, "budget", least=1)


class _WeakSource(LocalRef[Any]):
    """The controller measured, held weakly; a copy refers to it too, a pickled one to none."""

    __slots__ = ()

    def __copy__(self) -> _WeakSource:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _WeakSource:
        return self
