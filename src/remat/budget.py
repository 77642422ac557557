"""The budget (`CheckpointConfig(budget="20GiB")`): the map planned by itself, between steps.

The first training forward with gradients (whoever calls it: `cm(...)`, Trainer, TRL) is measured on
its batch (`remat.planner`, one profile); every training forward then takes the plan of its token
count's bucket from that profile, chosen without running the model and cached. Buckets are geometric
(`bucket_of`), each planned for its largest count, so every step in it fits. A step no plan fits is
refused before its forward, naming the largest count that fits. The map changes in a forward's
pre-hook only, never while an earlier forward's backward is owed. The receipt keeps, per bucket, the
plan, its prediction and (on an accelerator) the allocator's measured peak.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .compat.accelerator import peak_allocated, reset_peak
from .compat.dispatch import compute_device
from .errors import ConfigError, StateError
from .memory_errors import BudgetExceededError
from .plan import head_label
from .refs import Ref

logger = logging.getLogger("remat")


Bucket = tuple[int, int | None]  # a step's tokens' bucket, and its rows' length bucket where they are long (`_bucket`)
EARLIER_PROFILES = 4  # profiles a model change set aside, kept to plan from when it changes back (`_back_to_earlier`)
EXTRAPOLATED = 4  # a bucket planned for more than this many times the profiled tokens says it is extrapolated


def bucket_of(tokens: int) -> int:
    """The largest token count of `tokens`' bucket: the smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two
    and one and a half times them) that is at least `tokens`: a step is planned for at most 1.5x its tokens."""
    power = 1 << max(0, (max(tokens, 1) - 1).bit_length() - 1)  # the largest power of two below tokens (or 1)
    return next(size for size in (power, power + power // 2, 2 * power) if size >= tokens)


@dataclass
class Receipt:
    """One bucket: its plan, what the plan predicted, and what ran.

    `steps` counts its training forwards (micro-batches), `head` names the head the last of them ran (the model's own
    for a call with return_dict=False or without labels); a bucket planned anew (another budget, a profile measured
    again) starts a new receipt. `measured_peak_bytes` is the largest allocator peak of its steps on an accelerator
    (None on a CPU, where the only count is a dispatch-mode watch that slows every op: `remat.testing`)."""

    bucket_tokens: int
    policies: tuple[str, ...]
    head: str
    predicted_bytes: int | None  # what `scope` bounds: the whole step's peak ("step"), or the held activations
    scope: str
    steps: int = 0
    measured_peak_bytes: int | None = None
    planning_seconds: float = 0.0
    bucket_length: int | None = None  # its rows' length, when longer than the profile's rows at its tokens

    def log_values(self) -> dict[str, float]:
        """Numbers for a trainer's logs (TensorBoard and W&B keep numbers only)."""
        values: dict[str, float] = {
            "remat/budget_bucket_tokens": self.bucket_tokens,
            "remat/budget_recomputed_layers": sum(p != "none" for p in self.policies),
        }
        if self.predicted_bytes is not None:
            values["remat/budget_predicted_bytes"] = self.predicted_bytes
        if self.measured_peak_bytes is not None:
            values["remat/budget_measured_bytes"] = self.measured_peak_bytes
        return values


@dataclass
class BudgetState:
    """What one wrapper's budget knows: the profile, the plans per bucket, the receipts."""

    config: Any = None  # the budget config the plans are for
    profile: Any = None  # remat.planner.Profile, measured on the first training step (or loaded)
    saved: Any = None  # a profile read from a save, used instead of measuring when it still describes the model
    plans: dict[Bucket, Any] = field(default_factory=dict)  # bucket -> PlannedConfig, or None: nothing fits
    # every choice made from the profile: (bucket, budget bytes, scope) -> plan or None (a refusal's search for what
    # fits, some twenty buckets, chose them again each time); apart from `plans`, whose first use checks the model
    searched: tuple[Any, dict[tuple[Bucket, int, str], Any]] = field(default_factory=lambda: (None, {}))
    active: Any = None  # the PlannedConfig the map runs (None: pending, before the first step)
    active_bucket: Bucket | None = None
    receipts: dict[tuple[Bucket, int], Receipt] = field(default_factory=dict)  # (bucket, number) -> its receipt
    history: list[Receipt] = field(default_factory=list)  # every receipt, in order: a bucket planned anew has two
    last_key: tuple[Bucket, int] | None = None  # (bucket, number: `receipt_ids`): the receipt of the step run last
    head_owed: Receipt | None = None  # the receipt of the forward in flight, until its head runs (`head_ran`)
    unlogged: set[tuple[Bucket, int]] = field(default_factory=set)  # the receipts' keys of forwards since a last log
    owed: set[object] = field(default_factory=set)  # forwards whose backward has not run (a token each)
    counting: Any = None  # the receipt of the forward running, until it returns (then one more of its steps)
    optimizer: Ref[Any] = field(default_factory=lambda: Ref(None))  # the trainer's (scope="step" counts its state)
    without_optimizer: bool = False  # its profile's step peak has no optimizer state
    fresh_key: Any = None  # `_model_key` when the profile was last found to describe the model
    params: list[Any] = field(default_factory=list)  # the model's parameters then
    kind: Any = None  # `step_kind` of the steps the profile above is for
    profiles: dict[Any, tuple[Any, ...]] = field(default_factory=dict)  # another kind -> its `_kind_state`
    earlier: list[tuple[Any, tuple[Any, ...]]] = field(default_factory=list)  # (kind, state) a model change set aside
    said_earlier: bool = False  # a model changed back to a state profiled before, said once
    # (kind, a profile's id) -> a number in the receipts' keys, and the profile (held: its id is not taken again)
    receipt_ids: dict[Any, tuple[int, Any]] = field(default_factory=dict)
    said_owed_kinds: set[Any] = field(default_factory=set)  # kinds priced from another's profile, said once
    said_two_graphs: bool = False  # a training forward while an earlier one's backward is owed, said once
    said_no_optimizer: bool = False  # a step budget measured with no optimizer known, said once

    def __reduce__(self) -> Any:
        """A copy (deepcopy, pickle) starts afresh: its profile would check and plan another wrapper's model."""
        return (BudgetState, ())

    def active_for(self, config: Any) -> Any:
        """The plan the map runs under `config` (None: pending, or another budget config, planned anew), changing
        nothing (a re-plan may still be refused)."""
        return None if config.budget is not None and config != self.config else self.active

    def config_changed(self, config: Any) -> None:
        """The wrapper's config is now `config`: another budget config plans again (the profile stays while it
        serves it); a config without a budget (a map by hand, measuring's own steps) leaves the plans as they are."""
        if config.budget is not None and config != self.config:
            self.config = config
            states = [*self.profiles.values(), *(state for _, state in self.earlier)]
            for plans in [self.plans, *(state[2] for state in states)]:
                plans.clear()
            self.searched = (None, {})  # plans carry the config's other fields (preserve_rng_state, ...)
            self.active = self.active_bucket = None
            self.receipts.clear()  # each bucket's plan under this budget is said, with a receipt of its own

    def take_saved(self, data: dict[str, Any] | None, source: str) -> None:
        """A profile read from a save, planned from on the next training step where it still describes the model
        and the machine (one measured in this process already is kept; a save without one drops an earlier's)."""
        from .planner.saved import SavedProfile

        if self.profile is None:
            self.saved = None if data is None else SavedProfile(source, data)

    def save_extras(self, config: Any, model: Any) -> dict[str, Any]:
        """What a save writes beside a budget config: the profile, so a resumed run need not measure."""
        from .planner.saved import profile_to_json

        if config.budget is not None and self.profile is None and self.saved is not None:
            return {"budget_profile": self.saved.data}  # loaded, not yet used: saved again as read (checked on use)
        if config.budget is None or self.profile is None:
            return {}
        return {
            "budget_profile": profile_to_json(self.profile, model, self.without_optimizer)
            | {"kind": _kind_text(self.kind)}
        }

    @property
    def last_bucket(self) -> int | None:
        return None if self.last_key is None else self.last_key[0][0]

    def set_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        self.optimizer = Ref(optimizer)

    def before_step(self, controller: Any, batch: dict[str, Any]) -> None:
        """Called in the model's forward pre-hook of a training forward with gradients."""
        from .planner.measuring import batch_length, batch_tokens, target_tokens  # what the activations grow with

        config, model = controller.config, controller.model
        tokens, length, targets = agreed_size(
            model, batch_tokens(batch, model), batch_length(batch, model), target_tokens(batch, model)
        )
        self._close_receipt()
        started = time.perf_counter()
        planned, bucket = self._plan_for(controller, batch, tokens, length, targets)
        if planned != self.active:  # another map (two buckets often plan the same one: nothing to apply)
            if self.owed:
                raise StateError(
                    f"budget: this forward ({tokens} tokens) needs the plan for {bucket_text(bucket)}, but an earlier "
                    "forward's backward has not run, and the map must not change inside a step. Call backward (or "
                    "drop that forward's outputs and what was made from them) first, or run this forward under "
                    "torch.no_grad() if it trains nothing; nothing was changed"
                )
            before, (self.active, self.active_bucket) = (self.active, self.active_bucket), (planned, bucket)
            try:
                controller.replan(config, controller.off_by, f"budget: a step of {tokens} tokens", said=True)
            except BaseException:  # the map of before stays (`Controller.replan`): so does its plan
                self.active, self.active_bucket = before
                raise
        if self.owed and not self.said_two_graphs:  # (a forward refused above holds no second graph)
            self.said_two_graphs = True
            logger.warning(
                "budget: a training forward (%d tokens) started while an earlier forward's backward is owed: both "
                "graphs are held at once, and each is planned as the step's only one, so the step holds more than "
                "its budget by what the earlier graph holds. Run them as one forward, or call backward between them",
                tokens,
            )
        # a bucket of each kind and profile (adapters switched to and fro plan from a profile each: a receipt each)
        number = self.receipt_ids.setdefault((self.kind, id(self.profile)), (len(self.receipt_ids), self.profile))[0]
        key = (bucket, number)
        receipt, new = self.receipts.get(key), _receipt(planned, bucket, controller.checkpoint_map.head)
        # said once per bucket and plan (not again on coming back to a bucket), nor per change of the head row (what
        # the last forward ran: the model's own head for a call with return_dict=False, the plan's on the next)
        plan_of = lambda r: (r.policies, r.predicted_bytes, r.scope)
        if receipt is None or plan_of(receipt) != plan_of(new):
            receipt = self.receipts[key] = new
            self.history.append(receipt)
            receipt.planning_seconds = time.perf_counter() - started
            measured = self.profile.measurements.tokens
            far = f" (extrapolated {bucket[0] / measured:.1f}x from the {measured} tokens profiled)"
            far = far if bucket[0] > EXTRAPOLATED * measured else ""
            kinds = {kind for kind, _ in self.receipt_ids}
            kind = f" ({_kind_text(self.kind)})" if len(kinds) > 1 else ""  # once two kinds plan apart
            said = bucket_text(bucket)
            logger.info("budget: steps of up to %s%s run %r%s", said, kind, controller.checkpoint_map, far)
        self.last_key, self.head_owed, self.counting = key, receipt, receipt
        self.unlogged.add(key)
        reset_peak()

    def head_ran(self, label: str) -> None:
        """The head this step's forward ran, on its receipt: the forward pre-hook that opened it saw the map's head
        row of the forward before (the model's own head after a return_dict=False call)."""
        if self.head_owed is not None:  # (none for a forward no budget planned: an old receipt stays as it was)
            self.head_owed.head, self.head_owed = label, None

    def _plan_for(
        self, controller: Any, batch: dict[str, Any], tokens: int, length: int, targets: int
    ) -> tuple[Any, Bucket]:
        """The plan for a step of `tokens` tokens in rows of `length` (and an encoder-decoder's `targets` target
        tokens), and the bucket it is planned for."""
        config, kind = controller.config, step_kind(controller.model, batch)
        why = "the first training step" if self.profile is None else None
        if why is None and kind != self.kind:  # a kind profiled before plans from its own profile and plans
            if kind in self.profiles:
                self.profiles[self.kind], state = self._kind_state(), self.profiles.pop(kind)
                self.profile, self.without_optimizer, self.plans, self.fresh_key, self.params = state
                self.kind = kind
            elif self.owed:  # measuring would run beside the graph an earlier forward holds: the next step measures
                if kind not in self.said_owed_kinds:
                    self.said_owed_kinds.add(kind)
                    logger.info(
                        "budget: a forward of another kind of step (%s) while an earlier forward's backward is owed: "
                        "priced from the profile measured on %s; measured at a step that starts after a backward",
                        _kind_text(kind),
                        _kind_text(self.kind),
                    )
            else:
                why = f"this step is not of the kind profiled (this: {_kind_text(kind)}; "
                why += f"profiled: {_kind_text(self.kind)})"
        if why := why or self._outgrown(config):
            self._measure(controller, batch, tokens, why=why, kind=kind)
        # every step: a cached plan is only as good as its profile (the full check when the quick key moves, and
        # for every bucket planned anew)
        unplanned = self._bucket(self._with_targets(tokens, targets), length) not in self.plans
        if _model_key(controller, self.params) != self.fresh_key or unplanned:
            if changes := self.profile.changes()[1]:
                self.profiles.clear()  # every other kind's profile is of the model before that change too
                if not self._back_to_earlier(config, changes):
                    self._measure(
                        controller, batch, tokens, why=f"the model changed since its profile ({'; '.join(changes)})"
                    )
            self.params = list(controller.model.parameters())
            self.fresh_key = _model_key(controller, self.params)
        source = tokens  # (the profile planned from is settled: measured anew above, or one measured before)
        if targets:  # each rank's profile has its own ratio: every rank plans the largest (as `agreed_size`)
            tokens = agreed_size(controller.model, self._with_targets(tokens, targets))[0]
        bucket = self._bucket(tokens, length)
        if bucket not in self.plans:
            self.plans[bucket] = self._choose(config, bucket)
        planned = self.plans[bucket]
        if planned is None:
            rows = "" if bucket[1] is None else f" in rows of {length}"
            if tokens > source:
                rows += (
                    f" (its {targets} target tokens at the profile's target-to-source ratio; {source} of the source)"
                )
            from .planner.measuring import virtual_tokens

            if virtual := virtual_tokens(controller.model):  # PEFT's prompt learning: rows longer than the batch's
                rows += f" ({virtual} virtual tokens a row included)"
            said = f"budget: a step of {tokens} tokens{rows} fits no map under budget={config.budget!r} "
            said += f"(budget_scope={config.budget_scope!r})"
            fitting, fewer_rows_fit = None, False
            if bucket[1] is None and (fits := self.largest_fitting(config, bucket[0])):
                fitting, fewer_rows_fit = f"the largest step that fits is {fits} tokens", fits >= length
            elif bucket[1] is not None and (rows := self.most_rows(config, tokens, length)):
                fitting, fewer_rows_fit = (
                    f"a step of up to {rows} row{'s' if rows > 1 else ''} of {length} tokens fits",
                    True,
                )
            elif bucket[1] is not None and (row := self.longest_row(config, length)):
                fitting = f"no step of such rows fits; one row of up to {row} tokens does"
            if fitting:
                # where fewer rows fit, an OutOfMemoryError too: Trainer's auto_find_batch_size=True shrinks the batch
                # (where only shorter rows fit, shrinking it reached zero and lost this message)
                error = BudgetExceededError if fewer_rows_fit else ConfigError
                raise error(
                    f"{said}: for the budget, out of memory. {fitting[0].upper()}{fitting[1:]}: make the batch "
                    "shorter or smaller, or give a larger budget. This forward did not run"
                )
            try:  # no step fits: the profile's own refusal names the smallest budget for this one
                self.profile.plan(config.budget_bytes, scope=config.budget_scope, tokens=bucket[0], length=bucket[1])
            except ConfigError as least:
                raise ConfigError(f"{said}, nor does any shorter step: {least}. This forward did not run") from None
        return planned, bucket

    def _bucket(self, tokens: int, length: int) -> Bucket:
        """The bucket of a step: its tokens' (`bucket_of`), and its rows' length where the rows are longer than the
        profile's rows at those tokens (fewer rows of the same tokens: a packed row, whose attention scores and mask
        grow with its length: a padded 8 x 32 profile under-priced a 1 x 256 row 1.7x); None where they are not (more
        rows of the same tokens are priced as the profile's rows, over-priced where attention is quadratic)."""
        m, bucket = self.profile.measurements, bucket_of(tokens)
        measured = m.length and m.shorter is not None  # (one length measured, images or audio: in proportion)
        return bucket, bucket_of(length) if measured and length * m.tokens > bucket * m.length else None

    def _with_targets(self, tokens: int, targets: int) -> int:
        """An encoder-decoder step's tokens in its profile's mix: the source's, or its targets' at the profile's
        target-to-source ratio, whichever is more (an upper bound on what both grow). A step of the same kind has
        targets up to 2x as long for its source as the profile's: priced at the source's tokens, held 1.47x (T5)."""
        profiled = self.profile.measurements
        if not (targets and profiled.target_tokens):
            return tokens
        return max(tokens, -(-targets * profiled.tokens // profiled.target_tokens))

    def _back_to_earlier(self, config: Any, changes: list[str]) -> bool:
        """Whether the model is back in a state a profile of this kind set aside measured (`set_adapter` between
        adapters, each change measured anew: a whole profile at every switch, 50x a step): its profile and plans
        serve again. The profile left is set aside in turn (the last `EARLIER_PROFILES`)."""
        kind, left = self.kind, (self.profile, self.without_optimizer, self.plans, None, [])
        back = next((e for e in self.earlier if e[0] == kind and not e[1][0].changes()[1]), None)
        kept = [e for e in self.earlier if e is not back][-EARLIER_PROFILES + 1 :]
        self.earlier = [*kept, (kind, left)]
        if back is None:
            return False
        self.profile, self.without_optimizer, self.plans = back[1][:3]
        if self._outgrown(config) is not None:  # (the optimizer known since): measured again, by the caller
            return False
        if not self.said_earlier:
            self.said_earlier = True
            logger.info(
                "budget: the model changed (%s) back to a state profiled before: its profile and plans serve again "
                "(said once)",
                "; ".join(changes),
            )
        return True

    def _kind_state(self) -> tuple[Any, ...]:
        return self.profile, self.without_optimizer, self.plans, self.fresh_key, self.params

    def _outgrown(self, config: Any) -> str | None:
        """Why the profile does not serve `config` although the model is the one measured (None: it does). The
        settings that change a measurement (swap, head, offload floor, reentrancy) are the model state's
        (`Profile.changes`); `every_n_layers`, `checkpoint_policy` and the budget itself change none."""
        if config.budget_scope == "step" and self.profile.measurements.step is None:
            return 'budget_scope="step" needs the peak of a whole step, which its profile did not measure'
        if config.budget_scope == "step" and self.without_optimizer and self.optimizer() is not None:
            return "the optimizer is known now, and its profile counted no optimizer state"
        return None

    def _choose(self, config: Any, bucket: Bucket) -> Any:
        """The plan for `bucket` (tokens, rows' length) under `config`'s budget; None when nothing fits. Each chosen
        once per profile (`searched`): a refused step's search for what fits chose some twenty buckets again at every
        refusal (0.6 s on 32 layers, each time)."""
        profile, found = self.searched
        if profile is not self.profile:
            self.searched = (self.profile, found := {})
        key = (bucket, config.budget_bytes, config.budget_scope)
        if key not in found:
            try:
                found[key] = self.profile.plan(key[1], scope=key[2], tokens=bucket[0], length=bucket[1])
            except ConfigError:  # (a StaleProfileError is not one: it reaches the caller)
                found[key] = None  # nothing fits: refused by the caller, with the largest count that fits
        return found[key]

    def largest_fitting(self, config: Any, above: int) -> int:
        """The largest bucket below `above` some plan fits (steps of up to that many tokens run); 0 if none."""
        fits, size = 0, 1
        while size < above and self._choose(config, (size, None)) is not None:
            fits, size = size, bucket_of(size + 1)
        return fits

    def most_rows(self, config: Any, tokens: int, length: int) -> int:
        """How many rows of `length` tokens a step of fewer than `tokens` tokens may have; 0 if not one."""
        rows = 0
        while (rows + 1) * length < tokens and self._choose(
            config, self._bucket((rows + 1) * length, length)
        ) is not None:
            rows += 1
        return rows

    def longest_row(self, config: Any, below: int) -> int:
        """The largest bucket of one row's tokens below `below` some plan fits; 0 if none."""
        fits, size = 0, 1
        while size < below and self._choose(config, self._bucket(size, size)) is not None:
            fits, size = size, bucket_of(size + 1)
        return fits

    def _measure(self, controller: Any, batch: dict[str, Any], tokens: int, why: str, kind: Any = None) -> None:
        from .planner import ProfileOptions, profile_model

        config, kind = controller.config, kind if kind is not None else self.kind  # the kind, once measured
        if self.saved is not None:
            saved, self.saved = self.saved, None
            changes = saved.differences(controller.model)
            if not changes and saved.data.get("kind", _kind_text(kind)) != _kind_text(kind):  # older saves: none
                changes = [f"it was measured on another kind of step ({saved.data['kind']}; this: {_kind_text(kind)})"]
            if not changes:  # the machine's and the format's; then the model's, as for any profile
                profile = saved.profile(controller)
                changes = [f"the model changed since ({change})" for change in profile.changes()[1]]
            if not changes:  # serves this config as a profile measured here would (the scope, the optimizer)
                self.profile, self.without_optimizer = profile, saved.without_optimizer
                if (outgrown := self._outgrown(config)) is None:
                    logger.info("budget: planning from the saved profile (%s); nothing measured", saved.source)
                    self.kind, self.plans = kind, {}
                    if self.without_optimizer and config.budget_scope == "step":
                        self._say_no_optimizer(controller, config)
                    return
                self.profile, self.without_optimizer = None, False  # not taken: a failed measuring leaves none
                changes = [outgrown]
            logger.info("budget: the saved profile is not used (%s): measuring again", "; ".join(changes))
        from .planner.peak import NO_OPTIMIZER_NOTE, WITHOUT_OPTIMIZER

        if not any(p.requires_grad for p in controller.model.parameters()) and not any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in batch.values()
        ):  # measuring runs backward: a frozen teacher's or a reference pass's forward has none to run
            raise StateError(
                "budget: a forward with gradients in training mode, but nothing in it trains (no parameter or input "
                "requires grad), so it is no training step to plan for: run it under torch.no_grad() (a frozen "
                "teacher, a reference pass); nothing was changed"
            )
        if self.owed:  # its steps would run beside the graph an earlier forward still holds
            raise StateError(
                f"budget: this forward needs a new profile ({why}), but an earlier forward's backward has not run. "
                "Call backward (or drop that forward's outputs and what was made from them) first, or run this "
                "forward under torch.no_grad() if it trains nothing; nothing was changed"
            )
        optimizer = self.optimizer() if config.budget_scope == "step" else None
        if optimizer is None and config.budget_scope == "step":
            optimizer = WITHOUT_OPTIMIZER
        loss_fn = None if batch.get("labels") is not None else logits_loss
        logger.info(
            "budget %r (%s): measuring a profile on this step (%d tokens): %s%s",
            config.budget,
            config.budget_scope,
            tokens,
            why,
            ""
            if loss_fn is None
            else " (no labels: measured with the model's own loss where it gives one, else a cross entropy over its "
            "logits, or the mean of its outputs without logits)",
        )
        if optimizer is WITHOUT_OPTIMIZER:
            self._say_no_optimizer(controller, config)
        if kind != self.kind and self.profile is not None and self.kind is not None:  # the kind that ran keeps its own
            self.profiles[self.kind] = self._kind_state()
        # one timed step per map: seconds scale every price by one rate, so a budget's choices (by bytes, then
        # by those prices) are the counts' whatever the noise; only the printed seconds are less sure
        # without labels, logits for every token, as the longest completion's would be: `logits_to_keep` (a GRPO-style
        # loop's completion length) changes from step to step within a bucket; a short one priced a longer 2x under
        measured = batch
        if loss_fn is not None:  # (with labels the model's loss needs the logits it keeps)
            measured = {k: v for k, v in batch.items() if k not in ("logits_to_keep", "num_logits_to_keep")}
        self.profile = profile_model(controller, measured, ProfileOptions(loss_fn, optimizer, True, 1))
        self.without_optimizer = optimizer is WITHOUT_OPTIMIZER
        if optimizer is WITHOUT_OPTIMIZER:  # every plan's printout says what its peak holds
            self.profile.notes += (NO_OPTIMIZER_NOTE,)
        self.plans, self.fresh_key, self.kind = {}, None, kind

    def _say_no_optimizer(self, controller: Any, config: Any) -> None:
        """Once per wrapper: a step budget whose profile counts no optimizer state (measured so, or saved so)."""
        if not self.said_no_optimizer:
            self.said_no_optimizer = True  # (a full fine-tune's AdamW state is twice its weights: 1.6x the budget)
            trained = sum(p.numel() * p.element_size() for p in controller.model.parameters() if p.requires_grad)
            logger.warning(
                "budget %r (step): no optimizer known, so each step's planned peak leaves out its state (AdamW's: "
                "twice the %.2f MiB of trainable weights). Hand it over: cm.set_optimizer(optimizer) (RematTrainer "
                "and TRL's trainers do)",
                config.budget,
                trained / 2**20,
            )

    def _close_receipt(self) -> None:
        """The step that ran last: its allocator peak into its bucket's receipt (accelerators only)."""
        receipt = self.receipts.get(self.last_key) if self.last_key is not None else None
        if receipt is not None and (peak := peak_allocated()) is not None:
            receipt.measured_peak_bytes = max(receipt.measured_peak_bytes or 0, peak)

    def watch_backward(self, output: Any) -> None:
        """This forward owes a backward until one of its outputs gets a gradient, or the graphs of all of them are
        freed (not the outputs: a loss made from one, as trainers return, holds the graph after the output is
        dropped). It ran: a step of its receipt (a forward that raised, out of memory, is none)."""
        if self.counting is not None:
            self.counting.steps, self.counting = self.counting.steps + 1, None
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if not tensors:
            return
        token, alive = object(), [len(tensors)]
        self.owed.add(token)

        def freed() -> None:
            alive[0] -= 1
            if alive[0] == 0:
                self.owed.discard(token)

        for tensor in tensors:
            tensor.register_hook(lambda grad: self.owed.discard(token))
            if (node := tensor.grad_fn) is None:  # a leaf: its graph is itself
                weakref.finalize(tensor, freed)
            else:
                marker = _GraphAlive()
                node.metadata[id(marker)] = marker
                weakref.finalize(marker, freed)


class _GraphAlive:
    """Kept in the metadata of an output's autograd node, so freed with the graph that node belongs to."""

    __slots__ = ("__weakref__",)


def agreed_size(model: Any, *counts: int) -> tuple[int, ...]:
    """The largest of every rank's counts (tokens, rows' length, targets), when torch.distributed runs with more than
    one: every rank then plans the same bucket, and a step too long for one is refused by all (none waits in an
    all-reduce for a rank that refused)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return counts
    backend = dist.get_backend()
    device = compute_device(model) if backend != "gloo" else torch.device("cpu")
    agreed = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return tuple(int(c) for c in agreed)


def bucket_text(bucket: Bucket) -> str:
    tokens, length = bucket
    return f"{tokens} tokens" + ("" if length is None else f" in rows of up to {length}")


def step_kind(model: Any, batch: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a step's bytes per token depend on beside the model, which its token count does not say: the inputs it
    carries beyond its tokens (pixel_values: a text-only profile priced the vision tower at nothing, 4x over on
    Qwen2-VL; not scalars such as Trainer's `num_items_in_batch`, nor tensors shaped as the tokens, such as an
    attention mask or position ids, which a collator may add to some batches only), autocast (its low-precision
    copies of the weights: 1.4x), and an encoder-decoder's target-to-source length ratio, in powers of two (a
    profile on short targets priced the decoder at their length: 8x over on T5, 3.4x on Whisper)."""
    from .planner.measuring import _is_target, batch_tokens

    target = batch.get("decoder_input_ids", batch.get("labels"))
    ids, embeds = batch.get("input_ids"), batch.get("inputs_embeds")
    shape = (
        ids.shape if isinstance(ids, torch.Tensor) else embeds.shape[:-1] if isinstance(embeds, torch.Tensor) else None
    )
    seq2seq = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    inputs = tuple(
        sorted(
            k
            for k, v in batch.items()
            if isinstance(v, torch.Tensor) and v.dim() and v.shape != shape and not (seq2seq and _is_target(k))
        )
    )  # (an encoder-decoder's targets are in the ratio below: shaped as the source by chance, they made another kind)
    casts = {d: torch.get_autocast_dtype(d) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)}
    for entered in _autocasts_of_forward(model):  # entered inside the call, after this pre-hook
        casts.pop(entered.device, None)
        casts.update({entered.device: entered.fast_dtype} if entered._enabled else {})
    autocast = tuple((d, casts[d]) for d in _AUTOCAST_DEVICES if d in casts)
    if not (seq2seq and isinstance(target, torch.Tensor) and target.numel()):
        return inputs, autocast, None
    source = batch_tokens({k: v for k, v in batch.items() if k not in ("labels", "decoder_input_ids")}, model)
    return inputs, autocast, round(math.log2(target.numel() / max(source, 1)))


def _autocasts_of_forward(model: Any) -> list[torch.amp.autocast]:
    """The autocasts a wrapper set on the instance's `forward` enters, outermost first: accelerate's mixed precision
    (Trainer's `bf16=True`) wraps `model.forward` in `torch.autocast` as a decorator, which runs after the forward
    pre-hooks, so a step's kind read there said "autocast off" (a profile measured in fp32 priced bf16 steps)."""
    found, func, seen = [], getattr(model, "__dict__", {}).get("forward"), set()
    while func is not None and id(func) not in seen:  # each decorator's `__wrapped__` (functools.wraps)
        seen.add(id(func))
        func = getattr(func, "__func__", func)
        for cell in getattr(func, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                if isinstance(cell.cell_contents, torch.amp.autocast):
                    found.append(cell.cell_contents)
        func = getattr(func, "__wrapped__", None)
    return found


# the device types torch keeps an autocast state for (`torch.is_autocast_enabled` raises for others, "meta"): each
# asked, a few C calls a step, rather than walking the model's parameters for the ones it uses
_AUTOCAST_DEVICES = ("cpu", "cuda", "hpu", "ipu", "mps", "mtia", "privateuseone", "xla", "xpu")


def _kind_text(kind: tuple[Any, ...] | None) -> str:
    if kind is None:
        return "a step of unknown kind"
    inputs, autocast, ratio = kind
    autocast_text = ", ".join(f"{device} {str(dtype).removeprefix('torch.')}" for device, dtype in autocast) or "off"
    text = f"inputs {', '.join(inputs) or 'tokens only'}; autocast {autocast_text}"
    return text if ratio is None else f"{text}; target about 2**{ratio} x the source's length"


def _model_key(controller: Any, params: list[Any]) -> tuple[Any, ...]:
    """What a profile's validity depends on, cheap enough for every step: the dtype, device and training flag of the
    parameters the model had when last checked, which embedding and head modules it has (one set in place of another)
    and their weights' shapes (a resized embedding keeps its Parameter), its adapters and active ones, the config,
    attention.
    (`Profile.changes` reads the whole state, every parameter by name, when this moves, and for every bucket
    planned anew: a parameter added elsewhere outside PEFT is seen there.)"""
    from .planner.state import adapters_of, attention_of

    model = controller.model
    flags = tuple((p.dtype, p.device, p.requires_grad) for p in params)
    ends = (_end(model, "get_input_embeddings"), _end(model, "get_output_embeddings"))
    return flags, ends, adapters_of(model), id(controller.config), attention_of(model)


def _end(model: Any, getter: str) -> tuple[int, Any] | None:
    """The module `model.<getter>()` returns and its weight's shape (None where the model has none: remote code may
    raise): the shapes of every parameter cost 17 ms a step on a 19k-parameter MoE."""
    try:
        module = getattr(model, getter)()
    except (AttributeError, NotImplementedError):
        return None
    return id(module), getattr(getattr(module, "weight", None), "shape", None)


def logits_loss(outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor:
    """A loss for profiling a batch without labels (GRPO, DPO, label smoothing: the trainer computes its loss from
    the logits): a cross entropy over them, which holds a log-softmax over the vocabulary for its backward as the
    trainer's loss does (their mean held none: a label-smoothed step peaked at 1.45x its prediction); the model's own
    loss where it gave one (its targets under another name); a model without logits (an encoder's
    `last_hidden_state` pooled by the caller, QA's start and end logits) the mean of each floating output that has
    a gradient (a KeyError 'logits' failed every training step)."""
    if isinstance(loss := outputs.get("loss") if isinstance(outputs, Mapping) else None, torch.Tensor):
        return loss
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else None
    if isinstance(outputs, tuple):  # return_dict=False: the logits first, after an MoE's aux loss where it has one
        logits = next((t for t in outputs if isinstance(t, torch.Tensor) and t.dim()), None)
    if isinstance(logits, torch.Tensor) and logits.dim():
        flat = logits.float().reshape(-1, logits.shape[-1])
        return torch.nn.functional.cross_entropy(flat, flat.new_zeros(flat.shape[0], dtype=torch.long))
    graded = [t for t in _tensors(outputs) if t.is_floating_point() and t.requires_grad]
    if not graded:
        raise ConfigError(
            f"budget: {type(outputs).__name__} has no loss, logits or other output with a gradient to measure a "
            "training step by; give the batch labels, or plan by hand (cm.profile(batch, loss_fn=...).plan(...))"
        )
    return torch.stack([t.float().mean() for t in graded]).sum()


def _tensors(output: Any) -> list[torch.Tensor]:
    values = (
        output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else [output]
    )
    return [v for v in values if isinstance(v, torch.Tensor)]


def _receipt(planned: Any, bucket: Bucket, running: Any) -> Receipt:
    """`running`: the map's head row, which names the chunk the head runs (a config may leave it to the head)."""
    peak = planned.predicted_peak_bytes if planned.scope == "step" else planned.predicted_device_bytes
    head = running.label if running is not None else head_label(planned.head, planned.head_chunk_tokens)
    policies = tuple(c.policy for c in planned.choices)
    return Receipt(bucket[0], policies, head, peak, planned.scope, bucket_length=bucket[1])
