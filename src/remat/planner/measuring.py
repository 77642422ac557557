"""Measuring a profile: a few training steps under chosen maps, then everything put back as it was (README, "How it
measures"). Bytes (`_bytes`, one `memory_report` a step): each policy in mixed maps (step k gives layer i policy
number i + k: on transformers 4.57 a "none" layer holds more while another is checkpointed), split when one runs out
of memory. With an optimizer each step also takes its step, for the peak (`peak`); for plain text all again at half
the length, for what grows with its square (`Measurements.scaled`). Time: `timing`. Batch tensors that require grad
get fresh leaves (`remat.loss.own_inputs`), so a soft prompt's gradient is untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..arguments import check_flag, check_optimizer
from ..compat.accelerator import OUT_OF_MEMORY, empty_cache, synchronize
from ..compat.dispatch import compute_device
from ..config import CheckpointConfig
from ..errors import ConfigError, PolicyError, RematError, StateError
from ..head import DEFAULT_CHUNK_TOKENS, IGNORE_INDEX, causal_lm, plan_head
from ..loss import LossFn, check_loss_source, own_inputs, step_backward, step_loss
from ..memory_errors import OutOfMemoryError
from ..policies import LayerProfile, policy
from ..report import BUFFER_COPY_LIMIT, Measured, counters_left_as_they_were, memory_report
from ..snapshot import model_left_as_it_was
from .chooser import SMALLEST_CHUNK, HeadProfile, Measurements, Outside, StepMemory, TimePrices
from .peak import WITHOUT_OPTIMIZER, StepPeak
from .timing import BALANCES, Held, Seconds, price_time, timed_policies

HEAD_CHUNK_OPS = 8  # ops each chunk of the chunked head launches (slice, matmul, upcast, cross entropy), forward

CANDIDATES = ("none", "selective", "recompute", "offload")
BUSY_SPREAD = 0.25  # the rate's interquartile range, as a share of it, beyond which a profile says so

logger = logging.getLogger("remat")


@dataclass(frozen=True)
class ProfileOptions:
    """`cm.profile`'s keyword arguments (documented there), checked once."""

    loss_fn: LossFn | None
    optimizer: torch.optim.Optimizer | None
    progress: bool
    repeats: int

    def __post_init__(self) -> None:
        check_flag(self.progress, "progress")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ConfigError(f"repeats must be an int >= 1, got {self.repeats!r}")
        if self.optimizer is not WITHOUT_OPTIMIZER:
            object.__setattr__(self, "optimizer", check_optimizer(self.optimizer))


class Controlled(Measured, Protocol):
    """What measuring reads and changes of a wrapper's controller (`remat.controller.Controller`)."""

    config: CheckpointConfig
    off_by: str | None
    measuring: bool

    @property
    def is_enabled(self) -> bool: ...

    def enable(self, config: CheckpointConfig) -> None: ...

    def replan(self, config: CheckpointConfig, off_by: str | None, cause: str) -> None: ...


def check_measurable(state: Controlled, batch: Mapping[str, Any], loss_fn: LossFn | None) -> None:
    """Everything that refuses a profile, before any work."""
    model = state.model
    if not state.is_enabled or state.inference or not model.training:
        raise StateError("profile measures training steps: call cm.enable() and cm.for_training() first")
    if stepping := [n for n, p in model.named_parameters() if getattr(p, "_post_accumulate_grad_hooks", None)]:
        raise StateError(
            f"profile runs training steps, and {stepping[0]} (and {len(stepping) - 1} more) has a "
            "post-accumulate-grad hook (an optimizer stepping in backward): measuring would train the model. "
            "Plan before registering those hooks"
        )
    check_loss_source(model, batch, loss_fn, "profile")


def batch_tokens(batch: Mapping[str, Any], model: Any = None) -> int:
    """What a step's activations grow with, "tokens": batch x sequence length (of `input_ids` or `inputs_embeds`, with
    the virtual tokens PEFT's prompt learning puts before each row inside `model`), of an image batch its pixels, of
    audio its samples or feature frames (`_rows_and_length`)."""
    rows, length = _rows_and_length(batch, model)
    return rows * length


def batch_length(batch: Mapping[str, Any], model: Any = None) -> int:
    """The rows' length, as `batch_tokens` counts them (sequence length, padding included; an image's pixels)."""
    return _rows_and_length(batch, model)[1]


def target_tokens(batch: Mapping[str, Any], model: Any) -> int:
    """An encoder-decoder's target tokens (its decoder's input ids, else its labels), which `batch_tokens` leaves
    out; 0 for any other model, or a batch without targets."""
    target = batch.get("decoder_input_ids", batch.get("labels"))
    return target.numel() if _seq2seq(model) and isinstance(target, torch.Tensor) else 0


def virtual_tokens(model: Any) -> int:
    """The virtual tokens PEFT's prompt learning (prompt tuning, p-tuning, ...) adds before every row inside the
    model: a step of 16 x 4 ids with 32 of them runs 16 x 36 (counted without them, such a step held 4.5x its
    prediction). Prefix tuning's go to each layer's cache instead, not into the rows."""
    config = getattr(model, "active_peft_config", None)
    if not getattr(config, "is_prompt_learning", False) or config.peft_type in ("PREFIX_TUNING", "CARTRIDGE"):
        return 0
    return int(getattr(config, "num_virtual_tokens", 0) or 0)


# Inputs besides token ids, with where their length starts: an image's (C, H, W) grow with H x W, a video's
# (T, C, H, W) with T x H x W, audio features with their frames (the longer of the two axes: Whisper's are (mel bins,
# frames), Speech2Text's (frames, features)), samples with themselves
_LENGTH_FROM = {"pixel_values": -2, "pixel_values_videos": -2, "input_features": -1, "input_values": 1}


def _rows_and_length(batch: Mapping[str, Any], model: Any) -> tuple[int, int]:
    if isinstance(ids := batch.get("input_ids"), torch.Tensor):
        rows, length = (
            (ids.numel() // ids.shape[-1], ids.shape[-1]) if ids.dim() and ids.shape[-1] else (1, ids.numel())
        )
        return rows, length + virtual_tokens(model)
    if isinstance(embeds := batch.get("inputs_embeds"), torch.Tensor) and embeds.dim() >= 2:
        return embeds.numel() // embeds.shape[-1] // embeds.shape[-2], embeds.shape[-2] + virtual_tokens(model)
    for key, start in _LENGTH_FROM.items():
        if not (isinstance(value := batch.get(key), torch.Tensor) and value.dim() >= 2):
            continue
        if key.startswith("pixel_values") and value.dim() == 2:
            return 1, value.shape[0]  # flattened patches (Qwen2-VL's), one row
        if key == "input_features" and value.dim() == 3:
            return value.shape[0], max(value.shape[1:])  # frames: Whisper's (mel bins, frames), others' transposed
        length = math.prod(value.shape[start:])
        if key == "pixel_values_videos" or (key == "pixel_values" and value.dim() == 5):
            length *= value.shape[1]  # a video's frames
        return value.shape[0], length
    # else the first tensor of 2+ dims that is no target (a CTC batch's labels may come first)
    inputs = (v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 2 and not _is_target(k))
    return next(((v.shape[0], v.shape[1]) for v in inputs), (1, 1))


def _is_target(key: str) -> bool:
    return "label" in key or key.startswith("decoder_")


def candidates(state: Controlled) -> tuple[list[str], list[str]]:
    """The policies worth measuring on this model, and notes on those left out."""
    cpu, reentrant = compute_device(state.model).type == "cpu", state.config.use_reentrant
    names = [
        n for n in CANDIDATES if not (n == "offload" and cpu) and not (policy(n).needs_non_reentrant and reentrant)
    ]
    notes = []
    if cpu:
        notes.append("offload not considered: the model runs on the CPU, so it would free no device memory")
    if reentrant and "selective" not in names:
        notes.append("selective not considered: it needs use_reentrant=False")
    return names, notes


class _Steps:
    """Runs the measuring steps on the controller's model, counting them on a progress bar. A layer "selective"
    refuses (`refused`: layer -> the op it changes in place, or "") recomputes instead, in this step and every later
    one: the step runs again without it."""

    def __init__(
        self,
        state: Controlled,
        batch: dict[str, Any],
        loss_fn: LossFn | None,
        optimizer: Any,
        bar: Any,
        refused: dict[int, str],
        config: CheckpointConfig,
    ):
        """`config`: the wrapper's when the profile began (a head measured since leaves the wrapper at another)."""
        self.state, self.batch, self.loss_fn, self.bar, self.refused = state, batch, loss_fn, bar, refused
        self.model = state.model
        self.device = compute_device(self.model)
        self.peak = StepPeak(self.model, batch, optimizer, self.device)
        self.extras: dict[tuple[str, bool], int] = {}  # (last layer's policy, checkpointing) -> peak - held
        self.n = len(state.checkpoint_map)
        self.out_of_memory: BaseException | None = None  # the last step's that ran out
        self.base = config.replace(budget=None, layer_policies=dict.fromkeys(range(self.n), "recompute"))

    def _run(self, policies: Mapping[int, str], step: Callable[[], Any], head: dict[str, Any] | None = None) -> Any:
        """`step()` under `policies` (the other layers recomputing; `head`: config fields of another head); None if
        it ran out of memory."""
        while True:
            policies = {i: p for i, p in policies.items() if not self.refuses(i, p)}
            self.state.enable(
                self.base.replace(layer_policies={**self.base.layer_policies, **policies}, **(head or {}))
            )
            try:
                found = step()
            except OUT_OF_MEMORY as error:  # kept as a copy: its traceback and context hold the failed step's tensors
                found, self.out_of_memory = None, torch.OutOfMemoryError(*error.args)
                gc.collect()
                empty_cache()
            except PolicyError as error:
                # "selective" refusing a layer it was measured on (an in-place change of a kept output): that
                # layer recomputes from now on; any other PolicyError is the user's to see
                if error.layer is None or policies.get(error.layer) != "selective":
                    raise
                self.model.zero_grad(set_to_none=True)
                self.refused[error.layer] = error.op
                continue
            break
        self.model.zero_grad(set_to_none=True)
        self.bar.update(1)
        return found

    def held(self, policies: Mapping[int, str], head: dict[str, Any] | None = None) -> Any:
        """One step's memory report (with an optimizer: its step too, its peak into `extras`)."""

        def step() -> Any:
            with self.peak() as optimizer:
                report = memory_report(self.state, self.batch, self.loss_fn)
                if optimizer is not None:
                    self.peak.optimizer_steps()
                    optimizer.step()
            if (extra := self.peak.extra(report)) is not None:
                plans = list(self.state.checkpoint_map)
                key = (plans[-1].policy, any(plan.checkpointed for plan in plans))
                self.extras[key] = max(self.extras.get(key, extra), extra)
            return report

        return self._run(policies, step, head)

    def timed(self, policies: Mapping[int, str], within: contextlib.AbstractContextManager) -> float | None:
        """Seconds of a forward and backward under `policies` inside `within` (None: out of memory)."""

        def step() -> float:
            synchronize(self.device)
            start = time.perf_counter()
            with within:
                step_backward(step_loss(self.model, self.batch, self.loss_fn), self.model)
            synchronize(self.device)
            return time.perf_counter() - start

        return self._run(policies, step)

    def refuses(self, layer: int, name: str) -> bool:
        return name == "selective" and layer in self.refused


def _rotation(names: list[str]) -> list[str]:
    """The policies the mixed memory maps rotate through (at least two)."""
    rotation = [name for name in names if name not in ("recompute", "offload")] or ["none"]
    return rotation if len(rotation) > 1 else [*rotation, "recompute"]


def _refused_note(refused: Mapping[int, str]) -> str:
    layers, ops = sorted(refused), sorted({op for op in refused.values() if op})
    one = len(layers) == 1
    which = f"layer {layers[0]}" if one else f"layers {', '.join(map(str, layers))}"
    changes = f" ({', '.join(ops)})" if ops else ""
    return (
        f"selective not considered on {which}: {'it changes' if one else 'each changes'} in place an "
        f"output that selective keeps for backward{changes}, which selective refuses; "
        f"{'that layer takes' if one else 'those layers take'} one of the other policies"
    )


def measure(state: Controlled, batch: Mapping[str, Any], options: ProfileOptions) -> tuple[Measurements, list[str]]:
    """The measurements, and notes on what was left out or done differently."""
    from transformers.utils.logging import tqdm

    loss_fn, optimizer, repeats = options.loss_fn, options.optimizer, options.repeats
    names, notes = candidates(state)
    n = len(state.checkpoint_map)
    swapped = {p.index for p in state.checkpoint_map if p.swapped}
    rotation = _rotation(names)
    short = shorter_batch(batch, seq2seq=_seq2seq(state.model))
    memory_steps = (1 + len(rotation) + ("offload" in names) + (n > 1 and not swapped)) * (1 if short is None else 2)
    timing = repeats * (len(timed_policies(names)) + ("offload" in names))
    counted = head_options(state, batch)
    # plain, and each chunk size `_head_profile` measures: with every layer recomputed, and again with the last "none"
    head = (1 + len(_head_sizes(counted))) * (1 + (n - 1 not in swapped)) if counted else 0
    total = memory_steps + 1 + ("selective" in names) + timing + head  # bytes, counting, timing, the head
    shown = {} if options.progress else {"disable": True}  # shown: tqdm's own switch holds (TQDM_DISABLE=1)
    with (
        tqdm(total=total, desc="remat: profiling", leave=False, **shown) as bar,
        _left_as_it_was(state),
        _young_garbage_only(),
    ):
        refused: dict[int, str] = {}  # the layers "selective" refuses, found by any step
        config = state.config
        steps = _Steps(state, own_inputs(batch), loss_fn, optimizer, bar, refused, config)
        found = _bytes(steps, names, rotation, swapped, notes)
        if refused and not found.held.get("selective"):  # no layer takes it: neither counted nor offered
            names = [name for name in names if name != "selective"]
            rotation = _rotation(names)
        seconds, base, prices, timing_notes = price_time(steps, names, found.held, repeats)
        notes += [*timing_notes, prices.summary()]
        if prices.spread() > BUSY_SPREAD:
            notes.append(
                f"time: the machine was busy while profiling (the rate's quartiles are {prices.spread():.0%} of it "
                "apart): predicted seconds are that uncertain; the choice of map depends only on the counts"
            )
        head = _head_profile(steps, counted, prices, notes) if counted else None
        shorter = None
        if short is not None:
            # bytes at a second length, so that `tokens` can model what grows with the square of it
            at_short = _Steps(state, own_inputs(short), loss_fn, optimizer, bar, refused, config)
            ratio = batch_tokens(short, state.model) / batch_tokens(batch, state.model)
            scaled = {name: {i: t * ratio for i, t in per_layer.items()} for name, per_layer in seconds.items()}
            try:
                found_short = _bytes(at_short, names, rotation, swapped, [])
            except RematError:
                raise
            except Exception as error:  # a model that takes some lengths only (xLSTM's multiple of its chunk_size)
                notes.append(
                    "tokens: bytes scale in proportion (measured at one length: the model refused half of it, "
                    f"{type(error).__name__}: {str(error)[:200]})"
                )
            else:
                shorter = _measurements(
                    at_short, names, found_short, swapped, scaled, base * ratio, prices.scaled(ratio)
                )
        else:
            notes.append("tokens: bytes scale in proportion (the batch is not plain text: measured at one length)")
        # after the shorter length: a layer refused "selective" at that length only is offered it at neither
        measured = _measurements(steps, names, found, swapped, seconds, base, prices)
        measured = dataclasses.replace(measured, head=head, shorter=shorter)
    if refused:
        notes.append(note := _refused_note(refused))
        logger.info("profile: %s", note)
    return measured, notes


@dataclass
class _Bytes:
    """Per policy and layer (device, host) bytes held; each layer's input; bytes outside the layers
    by checkpointing; the map that checkpoints nothing (None: not offered); the step's extras."""

    held: Held
    inputs: dict[int, int]
    outside: dict[bool, int]
    alone: dict[int, tuple[int, int]] | None
    extras: dict[tuple[str, bool], int]


def _bytes(steps: _Steps, names: list[str], rotation: list[str], swapped: set[int], notes: list[str]) -> _Bytes:
    n = steps.n
    everything = range(n)
    held: Held = {name: {} for name in names}
    outside = {True: 0, False: 0}

    def record(report: Any, policies: Mapping[int, str]) -> None:
        checkpointing = any(plan.checkpointed for plan in steps.state.checkpoint_map)
        outside[checkpointing] = max(outside[checkpointing], report.outside_device_bytes)
        for i, name in policies.items():
            if not steps.refuses(i, name):
                held[name][i] = (report.layers[i].device_bytes, report.layers[i].host_bytes)

    if (report := steps.held({})) is None:
        raise OutOfMemoryError(
            "profiling: even with every layer recomputed, one step of this batch ran out of memory. No map can fit "
            "it: try a smaller batch"
        ) from steps.out_of_memory
    record(report, dict.fromkeys(everything, "recompute"))
    inputs = {i: sum(held["recompute"][i]) for i in everything}
    turn = lambda i, k: rotation[(i + k) % len(rotation)]
    pending = [
        {i: turn(i, k) for i in everything if not (i in swapped and turn(i, k) == "none")} for k in range(len(rotation))
    ]
    if "offload" in names:
        pending.append(dict.fromkeys(everything, "offload"))
    split = False
    while pending:
        taken = pending.pop(0).items()
        if not (policies := {i: name for i, name in taken if name != "recompute" and not steps.refuses(i, name)}):
            continue
        if (report := steps.held(policies)) is not None:
            record(report, policies)
            continue
        by_policy = sorted(set(policies.values()))
        if len(by_policy) > 1:
            pending += [{i: p for i, p in policies.items() if p == name} for name in by_policy]
        elif len(policies) > 1:
            layers = sorted(policies)
            half = len(layers) // 2
            pending += [{i: policies[i] for i in layers[:half]}, {i: policies[i] for i in layers[half:]}]
        else:
            ((i, name),) = policies.items()
            notes.append(f"layer {i} cannot run {name!r} on this device with this batch")
        split = True
    if split:
        notes.append("some maps ran out of memory: measured in smaller groups of layers")
    # The map that checkpoints nothing, priced by its own run: not offered with swapped layers.
    alone: dict[int, tuple[int, int]] | None = None
    if not swapped and "none" in names:
        if n > 1:
            if (report := steps.held(dict.fromkeys(everything, "none"))) is not None:
                alone = {i: (layer.device_bytes, layer.host_bytes) for i, layer in enumerate(report.layers)}
                outside[False] = report.outside_device_bytes
            else:
                notes.append("the map that checkpoints nothing ran out of memory on this batch: not offered")
        elif 0 in held["none"]:
            alone = {0: held["none"][0]}  # n == 1: the rotation's "none" run checkpointed nothing
    return _Bytes(held, inputs, outside, alone, dict(steps.extras))


def _measurements(
    steps: _Steps, names: list[str], found: _Bytes, swapped: set[int], seconds: Seconds, base: float, prices: TimePrices
) -> Measurements:
    everything = range(steps.n)
    held = found.held
    measured = lambda name, i: i in held[name] and not steps.refuses(i, name)
    options = tuple(
        tuple(name for name in names if measured(name, i) and not (name == "none" and i in swapped)) for i in everything
    )
    profiles = tuple(
        LayerProfile(
            index=i,
            input_bytes=found.inputs[i],
            held={name: held[name][i] for name in names if measured(name, i)},
            seconds={name: seconds[name][i] for name in names if measured(name, i)},
        )
        for i in everything
    )
    peak = steps.peak
    return Measurements(
        layers=profiles,
        names=tuple(p.name for p in steps.state.checkpoint_map),
        options=options,
        outside=Outside(found.outside[True], found.outside[False]),
        alone=None if found.alone is None else tuple(found.alone[i] for i in everything),
        base_seconds=base,
        tokens=batch_tokens(steps.batch, steps.model),
        step=StepMemory(found.extras, peak.fixed, peak.optimizer_peak, peak.gradients) if found.extras else None,
        time=prices,
        length=batch_length(steps.batch, steps.model),
        square_per_row=not _seq2seq(steps.model),
        target_tokens=target_tokens(steps.batch, steps.model) or None,
    )


def _seq2seq(model: Any) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def head_options(state: Controlled, batch: Mapping[str, Any]) -> int:
    """The counted tokens when the profile measures the head's options (head="chunked" with no
    `head_chunk_tokens`, on a head remat chunks, a batch with labels, four counted tokens or more), else 0."""
    config, labels = state.config, batch.get("labels")
    if config.head != "chunked" or config.head_chunk_tokens is not None or not isinstance(labels, torch.Tensor):
        return 0
    # TRL's fused head computes the loss: measured as it runs, not chosen
    if batch.get("fused_lm_head") or plan_head("chunked", None, state.model).policy != "chunked":
        return 0
    counted = int((labels[..., 1:] != batch.get("ignore_index", IGNORE_INDEX)).sum())
    return counted if counted >= 4 else 0


def _head_sizes(counted: int) -> list[int]:
    profiled = min(DEFAULT_CHUNK_TOKENS, counted)
    sizes = {min(SMALLEST_CHUNK * 4**k, profiled) for k in range(8) if SMALLEST_CHUNK * 4 ** (k - 1) < profiled}
    sizes.add(profiled)  # at least the chunk the profile runs (4 counted tokens gave none: an IndexError)
    if profiled == counted and (below := 1 << ((counted - 1).bit_length() - 1)) > SMALLEST_CHUNK:
        # one chunk of all is cheaper than the line through the chunks below it (no second gradient of a trained
        # head's weight, no gradient of the hidden states assembled from slices): every chunk offered below it is
        # priced between points of two chunks or more, the largest of them measured
        sizes.add(below)
    return sorted(sizes)


def _head_profile(steps: _Steps, counted: int, prices: TimePrices, notes: list[str]) -> HeadProfile | None:
    """The head's bytes with every layer recomputed, less those of the chunk the profile ran: "plain", and "chunked"
    in steps of 4x from the smallest chunk up to that one (16, 64, 256, 1024 tokens at most); seconds by counts."""

    def measured(head: dict[str, Any], policies: Mapping[int, str] | None = None) -> tuple[int, int] | None:
        saved, steps.extras = steps.extras, {}
        try:
            report = steps.held(policies or {}, head)
        finally:
            extras, steps.extras = steps.extras, saved
        return None if report is None else (report.outside_device_bytes, next(iter(extras.values()), 0))

    sizes = _head_sizes(counted)
    profiled = sizes[-1]  # the chunk the profile ran
    found = {size: measured({"head_chunk_tokens": size}) for size in sizes}
    plain = measured({"head": "plain", "head_chunk_tokens": None})
    # With every layer recomputed the step peaks in the last layer's recompute, which can hide the head's own
    # backward (where a plain head's logits and a chunk's buffers peak): each option again with the last layer
    # "none", priced for maps ending so (`HeadChoice.extra_none`)
    last = steps.n - 1
    swapped = any(plan.swapped for plan in steps.state.checkpoint_map if plan.index == last)
    heads = [{"head": "plain", "head_chunk_tokens": None}] + [{"head_chunk_tokens": size} for size in sizes]
    at_none = [] if swapped else [measured(head, {last: "none"}) for head in heads]
    if plain is None or any(value is None for value in [*found.values(), *at_none]):
        notes.append("head: a step ran out of memory measuring the head's options: the plan keeps remat's chunk")
        return None
    own = found[profiled]
    own_none = at_none[1 + sizes.index(profiled)][1] if at_none else 0  # type: ignore[index]
    less = lambda pair: (pair[0] - own[0], pair[1] - own[1])  # type: ignore[index]
    head = causal_lm(steps.model).get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None and callable(getattr(head, "get_base_layer", None)):
        weight = head.get_base_layer().weight
    rate, balance = prices.seconds_per_flop, BALANCES.get(steps.device.type, BALANCES["cuda"])
    return HeadProfile(
        counted=counted,
        profiled=profiled,
        plain=less(plain),
        points=tuple((size, *less(found[size])) for size in sizes),  # type: ignore[misc]
        recompute_seconds=rate * 2 * counted * (weight.numel() if weight is not None else 0),
        chunk_seconds=rate * HEAD_CHUNK_OPS * balance.flops_per_op,
        extras_none=tuple(extra - own_none for _, extra in at_none) if at_none else None,  # type: ignore[misc]
    )


@contextlib.contextmanager
def _young_garbage_only() -> Iterator[None]:
    """Each memory step collects the garbage its forward left (reference cycles holding tensors) before counting
    what is held; with everything older frozen out of the collector's sight, a collection takes milliseconds,
    not the 0.3 s a process that imported transformers spends walking every object (2.3 s of a 3.3 s profile).
    A process that froze objects itself keeps its own freeze (and full collections)."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def shorter_batch(batch: Mapping[str, Any], seq2seq: bool = False) -> dict[str, Any] | None:
    """The batch at half its sequence length when it is plain text (every tensor of 2+ dims is
    (batch, sequence, ...) of the same sizes); None otherwise (images, audio). A padding-free row's
    flash-attention lengths (`cu_seq_lens_q/k`, `max_length_q/k`) are cut at the half too: kept whole,
    they handed the kernel sequences longer than the tokens given. For an encoder-decoder (`seq2seq`) whose
    source and target are token ids of two lengths, each is cut at its own half (the target-to-source ratio, part
    of the step's kind, kept): measured at one length, such a batch was priced in proportion to its tokens."""
    tensors = [v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 2]
    shapes = {tuple(v.shape[:2]) for v in tensors}
    ids = all(v.dim() == 2 and not v.is_floating_point() for v in tensors)
    if seq2seq and len(shapes) == 2 and ids and len({rows for rows, _ in shapes}) == 1:
        if min(seq for _, seq in shapes) < 4 or any(key.startswith(("cu_seq_lens", "max_length")) for key in batch):
            return None
        return {
            k: v[:, : v.shape[1] // 2].contiguous() if isinstance(v, torch.Tensor) and v.dim() >= 2 else v
            for k, v in batch.items()
        }
    if len(shapes) != 1 or (seq := next(iter(shapes))[1]) < 4:
        return None
    half = seq // 2
    # contiguous: a model may `.view` an input (T5's loss views its labels: a slice's view failed the profile)
    short = {
        k: v[:, :half].contiguous() if isinstance(v, torch.Tensor) and v.dim() >= 2 else v for k, v in batch.items()
    }
    for side in ("q", "k"):
        if (ends := batch.get(f"cu_seq_lens_{side}")) is None:
            continue
        rows = next(iter(shapes))[0]
        if not isinstance(ends, torch.Tensor) or ends.dim() != 1 or rows != 1 or int(ends[-1]) != seq:
            return None  # not one padding-free row as transformers' collators make it: measured at one length
        cut = torch.cat([ends[ends < half], ends.new_tensor([half])])
        short[f"cu_seq_lens_{side}"] = cut
        if f"max_length_{side}" in batch:
            short[f"max_length_{side}"] = int((cut[1:] - cut[:-1]).max())
    return short


@contextlib.contextmanager
def _left_as_it_was(state: Controlled) -> Iterator[None]:
    """Put back, whatever happens, what `model_left_as_it_was` does, the config, the on/off state
    and the counters (the optimizer's state: after each step, by `StepPeak`)."""
    config, off_by = state.config, state.off_by
    state.measuring = True  # the steps' maps (and the way back) are not logged as the user's changes
    try:
        with (
            counters_left_as_they_were(state),
            model_left_as_it_was(state.model, copy_limit=BUFFER_COPY_LIMIT, what="profile"),
        ):
            yield
    finally:  # runs even when putting the model or the counters back failed
        try:
            state.replan(config, off_by=off_by, cause="profile() (restoring)")
        finally:
            state.measuring = False
