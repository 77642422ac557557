"""Choosing a map from measurements: a pure function (no torch, no model), tested with hand-made ones.

A map's bytes and seconds are sums over its layers, with one exact correction: with offload, the
input of the last checkpointed layer stays on the device (backward needs it first).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from ..arguments import parse_count
from ..errors import ConfigError
from ..policies import LayerProfile, policy

FRONT_LIMIT = 20_000  # combinations kept per layer; far above what identical layers produce
SCOPES = ("activations", "step")
SMALLEST_CHUNK = 16  # tokens: the smallest chunk of the head a plan is offered (then powers of two)


class Outside(NamedTuple):
    """Bytes held outside the layers (embeddings, logits, loss), by whether any layer is checkpointed."""

    checkpointing: int
    not_checkpointing: int


@dataclass(frozen=True)
class StepMemory:
    """What a whole step needs besides the held activations, as `MemTracker` counts it (`peak -
    held`), by (the last layer's policy, whether any layer is checkpointed): the peak comes early
    in backward, so the rest of the map does not change it (on Llama and Qwen3 with LoRA, to the
    byte); with every weight trained it may come in the recomputes (`_recompute_floor`), or in the optimizer's step,
    measured apart (`optimizer`: it does not grow with the tokens)."""

    extras: Mapping[tuple[str, bool], int]
    fixed: int = 0  # of each extra, what no token count changes: weights, buffers, optimizer state (0: not known)
    optimizer: int = 0  # the optimizer's step's own peak, after backward (0: no optimizer, or not measured apart)
    gradients: int = 0  # the trained weights' gradients, which no token count changes either (0: not known)

    def extra(self, policies: Sequence[str]) -> int | None:
        """For a map: its key's measurement, else the largest measured (None: nothing measured)."""
        key = (policies[-1], checkpoints(policies)) if policies else None
        return self.extras[key] if key in self.extras else max(self.extras.values(), default=None)


class HeadChoice(NamedTuple):
    """A plan's head, and what it adds over the head the profile ran: bytes outside the layers,
    bytes of the step's extras, seconds."""

    policy: str
    chunk_tokens: int | None
    outside: int
    extra: int
    seconds: float
    extra_none: int | None = None  # the extra with the last layer "none" (None: not measured, `extra` serves)


@dataclass(frozen=True)
class HeadProfile:
    """The head measured at its options (profiled with head="chunked" and no `head_chunk_tokens`),
    as differences from the head the profile ran: "plain", and "chunked" at up to four chunk sizes
    (`points`: tokens, outside bytes, extra bytes). Between two points a chunk is priced on the line
    through them, below the first as the first: a step's peak is the larger of the head's (growing
    with the chunk) and another, so the line between two points never says less than the step
    holds. Seconds by counts: chunking runs the head's matmul again in backward over the counted
    tokens (`recompute_seconds`: its FLOPs times the profile's rate), plus each chunk's own ops
    (`chunk_seconds`). Chunks are offered in powers of two from `SMALLEST_CHUNK` tokens, and one chunk of all
    (the smallest is one of the points measured)."""

    counted: int  # tokens whose label counts
    profiled: int  # the chunk the profile ran
    plain: tuple[int, int]  # (outside, extra)
    points: tuple[tuple[int, int, int], ...]  # (chunk tokens, outside, extra), ascending
    recompute_seconds: float
    chunk_seconds: float
    # the extras of (plain, *points) measured with the last layer "none" (None: not measured)
    extras_none: tuple[int, ...] | None = None
    # priced for more tokens, or longer rows, than measured (never saved: a saved profile is as measured)
    grown: bool = field(default=False, metadata={"saved": False})

    def choices(self) -> list[HeadChoice]:
        own = self._seconds(self.profiled)
        sizes = [2**k for k in range(SMALLEST_CHUNK.bit_length() - 1, (self.counted - 1).bit_length())]  # < counted
        nones = self.extras_none
        at_none = nones and tuple((x, o, e) for (x, o, _), e in zip(self.points, nones[1:], strict=True))
        out = [HeadChoice("plain", None, *self.plain, -own, nones[0] if nones else None)]
        for chunk in [*sizes, max(self.counted, 1)]:
            none = self._bytes(chunk, at_none)[1] if at_none else None
            out.append(HeadChoice("chunked", chunk, *self._bytes(chunk), self._seconds(chunk) - own, none))
        return out

    def _bytes(self, chunk: int, points: tuple[tuple[int, int, int], ...] | None = None) -> tuple[int, int]:
        points = points or self.points
        if measured := next((point for point in points if point[0] == chunk), None):
            return measured[1], measured[2]  # a chunk measured: as measured
        if chunk <= points[0][0] or len(points) == 1:
            return points[0][1], points[0][2]
        # the segment that holds `chunk`, or the last one extended beyond the largest point
        lower = next((i for i in range(len(points) - 1) if chunk <= points[i + 1][0]), len(points) - 2)
        (x0, *y0), (x1, *y1) = points[lower], points[lower + 1]
        at = lambda a, b: round(a + (b - a) * (chunk - x0) / (x1 - x0))
        return at(y0[0], y1[0]), max(at(y0[1], y1[1]), y1[1] if chunk > x1 else y0[1])

    def _seconds(self, chunk: int | None) -> float:
        return 0.0 if chunk is None else self.recompute_seconds + self.chunk_seconds * math.ceil(self.counted / chunk)

    def scaled(self, ratio: float, shrunk: int, shrunk_none: int, grown: bool) -> HeadProfile:
        """For `ratio` times the tokens: the counted tokens, a plain head's logits and the recompute grow. A chunk's
        extra is a difference from the profiled head's step. Where that step's extra shrank (by `shrunk`; with the
        last layer "none", `shrunk_none`), a chunk keeps its whole (its buffers do not shrink; kept as a difference,
        plans for half the tokens were 1.8-4.6x under). Where it grew (`grown`: more tokens, or longer rows), the
        difference stays and the recomputes' floor takes no chunk's saving: a chunk's whole grown as the profiled
        step's or the layers' activations fell short of eager attention's scores at longer rows (1.45x under)."""
        nones = self.extras_none
        return replace(
            self,
            counted=max(1, round(self.counted * ratio)),
            plain=(round(self.plain[0] * ratio), round(self.plain[1] * ratio)),
            points=tuple((size, outside, diff + shrunk) for size, outside, diff in self.points),
            recompute_seconds=self.recompute_seconds * ratio,
            extras_none=nones and (round(nones[0] * ratio), *(diff + shrunk_none for diff in nones[1:])),
            grown=grown,
        )


@dataclass(frozen=True)
class TimePrices:
    """What a layer's seconds were made of (`remat.planner.timing`): per layer, the FLOPs and the
    `work` (FLOPs plus other ops' bytes and launches at the device's balance) a recompute and
    "selective" repeat (None: selective not counted); one rate per unit of work (the median of
    `samples` timed calls) and its quartiles, and those of the plain step over `steps` steps."""

    flops: tuple[int, ...]
    selective_flops: tuple[int, ...] | None
    work: tuple[float, ...]
    selective_work: tuple[float, ...] | None
    seconds_per_flop: float
    rate_range: tuple[float, float]
    base_range: tuple[float, float]
    samples: int
    steps: int
    whole: float = 1.0  # what a recompute adds to a step measured whole, over its timed calls (in the rate)

    @property
    def selective_share(self) -> float | None:
        """What "selective" costs of a recompute, counted (the median over layers)."""
        if self.selective_work is None:
            return None
        return statistics.median(s / w for s, w in zip(self.selective_work, self.work, strict=True))

    def scaled(self, ratio: float) -> TimePrices:
        """For `ratio` times the tokens: the counts grow with them, the rates stay."""
        grow = lambda counts: None if counts is None else tuple(type(c)(c * ratio) for c in counts)
        counts = {name: grow(getattr(self, name)) for name in ("flops", "selective_flops", "work", "selective_work")}
        return replace(self, **counts, base_range=(self.base_range[0] * ratio, self.base_range[1] * ratio))

    def seconds_range(self, added: float) -> tuple[float, float]:
        """A prediction's spread: the base's quartiles, and what the layers add at the rate's."""
        rate, (low, high) = self.seconds_per_flop, self.rate_range
        return (self.base_range[0] + added * low / rate, self.base_range[1] + added * high / rate)

    def spread(self) -> float:
        """The rate's interquartile range as a share of it: how steady the machine was."""
        return (self.rate_range[1] - self.rate_range[0]) / self.seconds_per_flop

    def summary(self) -> str:
        (low, high), rate = self.rate_range, self.seconds_per_flop
        text = (
            f"time: {rate * 1e12:.3g} ms per GFLOP of a layer's forward (bytes and op launches counted as FLOPs; "
            f"half the {self.samples} timed layer calls between {low * 1e12:.3g} and {high * 1e12:.3g})"
        )
        text += f"; a checkpoint measured whole costs {self.whole:.2f}x its timed calls"
        share = self.selective_share
        return text if share is None else f"{text}; selective costs {share:.2f} of a recompute"


@dataclass(frozen=True)
class Measurements:
    """Everything the chooser needs, measured on one batch of `tokens` tokens."""

    layers: tuple[LayerProfile, ...]
    names: tuple[str, ...]
    options: tuple[tuple[str, ...], ...]  # the policies each layer may take
    outside: Outside
    # per layer, held with nothing checkpointed (transformers 4.57 keeps more in a "none" layer
    # while another is checkpointed, so that map is priced by its own run); None: not offered
    alone: tuple[tuple[int, int], ...] | None
    base_seconds: float  # the step with nothing recomputed
    tokens: int
    step: StepMemory | None = None  # for scope="step"
    time: TimePrices | None = None  # how the seconds were priced; None for hand-made measurements
    shorter: Measurements | None = None  # the same bytes at a shorter length, when measured
    head: HeadProfile | None = None  # the head's options, when the profile may choose them
    length: int | None = None  # the profiled rows' length (None: not known, a profile saved before it was kept)
    # what grows with the square of the length grows per row (a decoder's attention scores and masks); False: it may
    # grow with the length alone (T5's relative position bias: fewer, longer rows held 3x a per-row price)
    square_per_row: bool = True
    target_tokens: int | None = None  # an encoder-decoder's profiled targets (None: no targets, or not encoder-decoder)

    def scaled(self, tokens: int | None, length: int | None = None) -> Measurements:
        """For a batch of `tokens` tokens in rows of up to `length`: bytes fitted through both lengths when `shorter`
        was measured (`_fit`: attention's scores and masks grow with the square of the length), else in proportion,
        as seconds are; the step's extras (weights, optimizer state) stay. Rows are taken as many as the profile's
        unless `length` says they are longer (fewer rows of the same tokens: a packed row): what grows with the square
        then grows with tokens x length, or, unless `square_per_row`, as the profile's rows of that length would (an
        upper bound). More rows than the profile's are priced as its rows, over-estimated where attention is
        quadratic."""
        tokens = self.tokens if tokens is None else parse_count(tokens, "tokens", "batch x sequence length")
        rows = self.tokens / self.length if self.length else None
        longer = length is not None and rows is not None and length * rows > tokens
        if tokens == self.tokens and not longer:
            return self
        ratio, short = tokens / self.tokens, self.shorter
        square = tokens * tokens  # (tokens / rows) ** 2 x the profile's rows
        if longer:
            square = tokens * length * rows if self.square_per_row else (rows * length) ** 2
        # each figure with its measurement at the shorter length (None: not measured)
        grow = lambda value, before: (
            round(value * ratio) if before is None else _fit(short.tokens, before, self.tokens, value, tokens, square)
        )
        pair = lambda now, before: (grow(now[0], before and before[0]), grow(now[1], before and before[1]))
        olds = short.layers if short else [None] * len(self.layers)
        layers = tuple(
            replace(
                p,
                input_bytes=grow(p.input_bytes, old and old.input_bytes),
                held={k: pair(v, old and old.held.get(k)) for k, v in p.held.items()},
                seconds={k: s * ratio for k, s in p.seconds.items()},
            )
            for p, old in zip(self.layers, olds, strict=True)
        )
        alone = self.alone and tuple(map(pair, self.alone, (short and short.alone) or [None] * len(self.alone)))
        step = self.step
        if step and short and short.step:
            before, fixed, gradients = short.step.extras, step.fixed, step.gradients

            def extra(now: int, shorter: int) -> int:
                """Fitted through the origin, the weights' bytes made the extras look sublinear, so the straight line
                priced fewer, longer rows of the same tokens as the profile's (BERT: 1.66x over the budget at 4x the
                length): for longer rows, fitted without them too, the larger of the two. For more tokens than
                profiled, at least the profile's own extra with what it holds beyond the bytes no token count
                changes (`fixed`, gradients) grown in proportion: a full fine-tune's short steps peak where the
                gradients fill up, and the two lengths' line priced 2x the tokens flat (T5 1.26x under, Llama 1.11x;
                now 1.08x, 1.09x: the peak moves to where the activations peak, which short steps do not show)."""
                fitted = grow(now, shorter)
                if longer and 0 < fixed <= min(now, shorter):
                    fitted = max(fitted, fixed + grow(now - fixed, shorter - fixed))
                if tokens <= self.tokens:
                    return fitted
                return max(fitted, _in_proportion(now, fixed + gradients, ratio))

            extras = {k: extra(v, before[k]) if k in before else v for k, v in step.extras.items()}
            step = StepMemory(extras, fixed, grow(step.optimizer, short.step.optimizer), gradients)
        elif step and tokens > self.tokens:  # one length measured (images, audio): kept flat, 1.46x under at 4x pixels
            step = replace(
                step, extras={k: _in_proportion(v, step.fixed + step.gradients, ratio) for k, v in step.extras.items()}
            )
        outside = Outside(*map(grow, self.outside, short.outside if short else (None, None)))
        base_seconds, time = self.base_seconds * ratio, self.time and self.time.scaled(ratio)
        # (the scaled extras have the measured ones' keys)
        shrunk = lambda key: max(0, self.step.extras[key] - step.extras[key]) if step and key in step.extras else 0
        grown = tokens > self.tokens or longer
        head = self.head and self.head.scaled(ratio, shrunk(("recompute", True)), shrunk(("none", True)), grown)
        return Measurements(
            layers, self.names, self.options, outside, alone, base_seconds, tokens, step, time, head=head
        )


def _in_proportion(now: int, constant: int, ratio: float) -> int:
    """A step's extra at `ratio` (> 1) times the tokens: what it holds beyond `constant` (weights, buffers, optimizer
    state, gradients: no token count changes them) grown in proportion, never less than now (`constant` 0: not
    known, kept as it is)."""
    return max(now, constant + round((now - constant) * ratio)) if 0 < constant <= now else now


def _fit(x1: int, y1: int, x2: int, y2: int, x: int, square: float | None = None) -> int:
    """A figure measured at sizes x1 < x2, at size x: `a*x + b*x**2` through both when it grows
    faster than the size (`square` in place of x**2 for rows longer than the profile's), else the
    straight line; never below zero."""
    if x1 == x2:
        return round(y2 * x / x2)
    if y2 * x1 > y1 * x2:
        b = (y2 * x1 - y1 * x2) / (x1 * x2 * (x2 - x1))
        a = (y1 - b * x1 * x1) / x1
        return max(0, round(a * x + b * (x * x if square is None else square)))
    return max(0, round(y1 + (y2 - y1) * (x - x1) / (x2 - x1)))


class Combination(NamedTuple):
    """Policies for the first layers, with what they add; `owed_bytes`: what stays on the device
    if the last checkpointed layer is offloaded and no later one is checkpointed."""

    device_bytes: int
    owed_bytes: int
    seconds: float
    policies: tuple[str, ...]
    head: HeadChoice | None = None  # its seconds are in `seconds`; its bytes `scoped_bytes` adds


@dataclass(frozen=True)
class LayerChoice:
    """One layer of a chosen map: its policy, and what it is predicted to hold and add."""

    index: int
    name: str
    policy: str
    device_bytes: int
    host_bytes: int
    seconds: float


@dataclass(frozen=True)
class Plan:
    """A chosen map and its prediction; `device_bytes` is what the scope bounds."""

    choices: tuple[LayerChoice, ...]
    outside_bytes: int
    activation_bytes: int
    device_bytes: int
    seconds: float
    scope: str
    peak_bytes: int | None  # the peak of one whole step, when the measurements have it
    seconds_range: tuple[float, float] | None = None  # the spread of `seconds` (quartiles of the rates)
    head: HeadChoice | None = None  # None: the head the profile ran


def combinations(m: Measurements) -> list[Combination]:
    """Every combination that no other beats in bytes and time, layer by layer."""
    last = len(m.layers) - 1
    front = [Combination(0, 0, 0.0, ())]
    for profile, names in zip(m.layers, m.options, strict=True):
        grown = []
        for name in names:
            cost, settles = policy(name).cost(profile), policy(name).checkpointed
            # A checkpointed layer settles what the one before owed. An offloaded layer owes what of
            # its input went to the host, except the last, measured with its input on the device.
            owes = min(profile.input_bytes, cost.host_bytes) if name == "offload" and profile.index != last else 0
            for c in front:
                owed = owes if settles else c.owed_bytes
                grown.append(
                    Combination(c.device_bytes + cost.device_bytes, owed, c.seconds + cost.seconds, (*c.policies, name))
                )
        # after the last layer, kept per last policy too: the step's peak depends on it
        front = undominated(grown, by_last_policy=profile.index == last)
    return front


def undominated(found: list[Combination], by_last_policy: bool = False) -> list[Combination]:
    """Those no other beats, per amount owed (and with `by_last_policy`, per last policy)."""
    kept: list[Combination] = []
    key = lambda c: (c.owed_bytes, c.policies[-1] if by_last_policy and c.policies else "")
    for group_key in sorted({key(c) for c in found}):
        group = _each_faster([(c.device_bytes, c) for c in found if key(c) == group_key])
        if len(group) > FRONT_LIMIT:  # thin evenly; the ends (least bytes, fastest) always stay
            step = len(group) / FRONT_LIMIT
            group = [group[int(i * step)] for i in range(FRONT_LIMIT)] + [group[-1]]
        kept += group
    return kept


def _each_faster(priced: list[tuple[float, Combination]]) -> list[Combination]:
    """Ascending in bytes, each strictly faster than every one with fewer (of two as fast, the one
    holding less serves every budget the other does)."""
    kept: list[Combination] = []
    for _, c in sorted(priced, key=lambda pair: (pair[0], _time(pair[1]))):
        if not kept or _time(c) < _time(kept[-1]):
            kept.append(c)
    return kept


def _time(c: Combination) -> float:
    """Seconds as compared: to the picosecond. Two maps of equal counts summed in another order can
    differ in the last bit; which one wins must not depend on the rate the machine gave."""
    return round(c.seconds, 12)


def checkpoints(policies: Sequence[str]) -> bool:
    return any(policy(name).checkpointed for name in policies)


def scoped_bytes(m: Measurements, c: Combination, scope: str) -> float:
    """Held device bytes, or with scope="step" the peak of the whole step (inf: not measured); a map
    that checkpoints nothing is priced by its own run (inf: not offered)."""
    head_outside, head_extra = (0, 0) if c.head is None else (c.head.outside, _head_extra(c))
    if checkpoints(c.policies):
        held = c.device_bytes + c.owed_bytes + m.outside.checkpointing + head_outside
    elif m.alone is None or len(m.alone) != len(c.policies):
        return float("inf")
    else:
        held = m.outside.not_checkpointing + sum(d for d, _ in m.alone) + head_outside
    if scope == "activations":
        return held
    extra = m.step.extra(c.policies) if m.step is not None else None
    if extra is None:
        return float("inf")
    return max(held + extra + head_extra, _recompute_floor(m, c), m.step.optimizer)


def _head_extra(c: Combination) -> int:
    """What the map's head adds to the step's extras, as measured with the last layer as the map's: with it
    recomputed the step may peak in that recompute, with it "none" in the head's own backward; else the larger."""
    head = c.head
    assert head is not None
    if head.extra_none is None or not c.policies or c.policies[-1] == "recompute":
        return head.extra
    return head.extra_none if c.policies[-1] == "none" else max(head.extra, head.extra_none)


def _recompute_floor(m: Measurements, c: Combination) -> int:
    """The least a map without offload can peak at in backward's recomputes. While layer j is recomputed (or runs its
    selective backward) every layer recomputing holds what it measured, at most its peak `P_R`; the map holds as much
    and, for each layer before j, what that layer keeps beyond its input. Taken at the map's last checkpointed layer,
    `P_R` plus those layers' excess bounds the recomputes' moments (the key by the last layer's policy prices the
    start of backward). On a full fine-tune the peak comes in the recomputes: priced by its key alone, every layer
    but the last recomputing was up to 12% low, 9% over its budget (the planner trial)."""
    key, policies = ("recompute", True), c.policies
    if m.step is None or key not in m.step.extras or "offload" in policies or not checkpoints(policies):
        return 0
    last = max(i for i, name in enumerate(policies) if name != "none")  # (no offload: the others checkpoint)
    inputs = [p.held["recompute"][0] for p in m.layers]  # what a recomputed layer keeps (a policy's cost, inlined)
    kept = zip(m.layers[:last], policies[:last], inputs, strict=False)
    excess = sum(max(0, p.held[name][0] - held) for p, name, held in kept)
    head = 0 if c.head is None else c.head.outside + c.head.extra  # measured with every layer recomputed, as P_R
    head = max(0, head) if m.head and m.head.grown else head  # (a smaller chunk's saving holds where measured)
    return m.outside.checkpointing + sum(inputs) + m.step.extras[key] + excess + head


def check_scope(m: Measurements, scope: str) -> None:
    if scope not in SCOPES:
        raise ConfigError(f"scope must be one of {SCOPES}, got {scope!r}")
    if scope == "step" and m.step is None:
        raise ConfigError(
            'scope="step" needs the peak of a whole step, which this profile did not measure: profile with the '
            "optimizer, cm.profile(batch, optimizer=optimizer)"
        )


def _priced(m: Measurements, scope: str) -> list[tuple[float, Combination]]:
    """Every combination, with every head the measurements offer, and its `scope` bytes."""
    check_scope(m, scope)
    found = combinations(m)
    if m.head is not None:
        found = [c._replace(seconds=c.seconds + h.seconds, head=h) for c in found for h in m.head.choices()]
    return [(scoped_bytes(m, c, scope), c) for c in found]


def choose(m: Measurements, budget: int, scope: str = "activations") -> Plan | None:
    """The fastest map whose `scope` bytes fit `budget`; None when nothing fits."""
    fitting = [c for nbytes, c in _priced(m, scope) if nbytes <= budget]
    return _plan(m, min(fitting, key=lambda c: (_time(c), c.device_bytes + c.owed_bytes)), scope) if fitting else None


def smallest(m: Measurements, scope: str = "activations") -> float:
    return min(nbytes for nbytes, _ in _priced(m, scope))


def frontier(m: Measurements, scope: str = "activations") -> list[Plan]:
    """Every undominated map: ascending in predicted bytes, each strictly faster than the one before."""
    return [_plan(m, c, scope) for c in _each_faster([pair for pair in _priced(m, scope) if pair[0] != float("inf")])]


def predicted(m: Measurements, policies: Sequence[str], scope: str = "activations") -> Plan:
    """The prediction for a map given layer by layer (each policy among that layer's options)."""
    check_scope(m, scope)
    if len(policies) != len(m.layers) or any(p not in o for p, o in zip(policies, m.options, strict=True)):
        raise ConfigError(f"a map names one of each layer's options {m.options}, got {list(policies)}")
    return _plan(m, _combination(m, policies), scope)


def native_points(m: Measurements, scope: str, every_n: tuple[int, ...]) -> dict[str, tuple[float, float]]:
    """transformers' own options, priced (bytes of `scope`, seconds): every n-th layer recomputed, or none."""
    n, out = len(m.layers), dict[str, tuple[float, float]]()
    maps = {f"every_n_layers={k}": ["recompute" if i % k == 0 else "none" for i in range(n)] for k in every_n}
    maps["no checkpointing"] = ["none"] * n
    for label, policies in maps.items():
        if any(p not in opts for p, opts in zip(policies, m.options, strict=True)):
            continue  # a swapped layer cannot be "none"
        c = _combination(m, policies)
        if (nbytes := scoped_bytes(m, c, scope)) != float("inf"):
            out[label] = (nbytes, max(0.0, m.base_seconds + c.seconds))
    return out


def _combination(m: Measurements, policies: Sequence[str]) -> Combination:
    """A whole map as one combination, with what the last offloaded layer owes on the device."""
    choices = _layer_choices(m, policies)
    return Combination(sum(x.device_bytes for x in choices), 0, sum(x.seconds for x in choices), tuple(policies))


def _plan(m: Measurements, c: Combination, scope: str) -> Plan:
    choices = _layer_choices(m, c.policies)
    checkpointing = checkpoints(c.policies)
    if not checkpointing:  # priced by its own run, which fits only when offered
        assert m.alone is not None
        choices = [replace(x, device_bytes=d, host_bytes=h) for x, (d, h) in zip(choices, m.alone, strict=True)]
    outside = m.outside.checkpointing if checkpointing else m.outside.not_checkpointing
    if c.head is not None:
        outside += c.head.outside
    held = int(outside + sum(x.device_bytes for x in choices))
    seconds = max(0.0, m.base_seconds + c.seconds)  # never negative, whatever the noise
    spread = None if m.time is None else m.time.seconds_range(c.seconds)
    peak = int(scoped_bytes(m, c, "step")) if m.step is not None and m.step.extras else None
    return Plan(tuple(choices), outside, held, int(scoped_bytes(m, c, scope)), seconds, scope, peak, spread, c.head)


def _layer_choices(m: Measurements, chosen: Sequence[str]) -> list[LayerChoice]:
    """Each layer's cost under its policy; the last checkpointed layer's input, when offloaded
    and not the last layer, stays on the device (measured so on the last layer only)."""
    costs = [(p.index, name, policy(name).cost(p)) for p, name in zip(m.layers, chosen, strict=True)]
    out = [LayerChoice(i, m.names[i], name, c.device_bytes, c.host_bytes, c.seconds) for i, name, c in costs]
    last = next((x for x in reversed(out) if policy(x.policy).checkpointed), None)
    if last is not None and last.policy == "offload" and last.index != len(out) - 1:
        moved = min(m.layers[last.index].input_bytes, last.host_bytes)
        out[last.index] = replace(last, device_bytes=last.device_bytes + moved, host_bytes=last.host_bytes - moved)
    return out
