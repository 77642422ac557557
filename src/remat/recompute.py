"""The recompute shim: what transformers' `GradientCheckpointingLayer` calls
(``layer._gradient_checkpointing_func(fn, *args)``) when remat sets its flag on the instance. Holders
(modules flagged only so transformers turns `use_cache` off) get `run_without_checkpoint`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from .compat.deepspeed import frozen_zero3_parameters_held
from .compat.dispatch import offloads_weights
from .errors import ConfigError
from .refs import Ref
from .snapshot import Watched

if TYPE_CHECKING:
    from .offload import Offloader
    from .policies import Policy
    from .swap import WeightSwapper

logger = logging.getLogger("remat")


def run_without_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The holder's function: run as is. Checkpointing is decided by each layer, not its parent."""
    return function(*args, **kwargs)


class _LayerState:
    """The buffers and numeric attributes a layer's forward changes (an MoE router's token counts), so the
    recompute leaves them as the forward did. Only those are written back: writing back every buffer would
    bump version counters a reentrant backward checks (rotary caches) and clone large caches each time."""

    def __init__(self, module: nn.Module):
        self.watched = Watched(module.modules())  # weakly: the shim lives on the layer
        self.changed = Watched()

    def watch_forward(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        before = self.watched.snapshot()
        out = function(*args, **kwargs)
        self.changed = before.changed()
        return out

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        saved = self.changed.snapshot(copy=True)
        try:
            yield
        finally:
            saved.restore()


_told: set[str] = set()


def distributed_training() -> bool:
    """Whether several processes train together. Reentrant checkpointing runs a backward per layer,
    which DDP sees as parameters marked ready twice; non-reentrant gives the same gradients without
    that, so it is used whenever torch.distributed runs several processes (said once)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    if "reentrant" not in _told:
        _told.add("reentrant")
        logger.info("use_reentrant=True is ignored under torch.distributed: remat checkpoints non-reentrantly")
    return True


class OwedRecompute:
    """A recompute that a checkpointed forward of a layer owes its backward, and the swapper it will ask for the
    layer's weights. Only that forward's recompute function holds it, so a graph dropped unrun owes nothing."""

    __slots__ = ("__weakref__", "swapper")

    def __init__(self, swapper: WeightSwapper):
        self.swapper = swapper


# layer -> the recomputes its checkpointed forwards owe, whichever wrapper ran them (weakly: a disabled or dropped
# wrapper leaves nothing on the layer, and its forward's backward must still find the layer's weights where it looks)
_OWED: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[OwedRecompute]] = weakref.WeakKeyDictionary()


def swappers_owed(module: nn.Module) -> list[WeightSwapper]:
    """The swappers the layer's owed recomputes will fetch its weights from (a weight another swapper moved out
    would be recomputed from its placeholder)."""
    return [owed.swapper for owed in _OWED.get(module, ())]


class LayerCheckpoint:
    """Checkpoint one layer as its policy (`remat.policies`) says. With `use_reentrant=True`, a layer whose
    inputs do not require grad (a frozen embedding under LoRA) would give an output with no grad_fn, and its
    LoRA weights would never learn: its first floating-point input is then made to require grad."""

    def __init__(
        self,
        index: int,
        policy: Policy,
        *,
        use_reentrant: bool,
        preserve_rng_state: bool,
        offloader: Offloader,
        offload: bool,
        swapper: WeightSwapper,
        module: nn.Module,
    ):
        self.index, self.policy, self.options = index, policy, policy.checkpoint_options(index)
        self.use_reentrant = use_reentrant  # CheckpointConfig refuses it for policies that need non-reentrant
        self.preserve_rng_state = preserve_rng_state
        self.offloader, self.offload = offloader, offload
        self.swapper = swapper  # asked at recompute time: the swapped set may change between forward and backward
        self.state = _LayerState(module)
        self._module = Ref(module)  # weakly: the shim lives on the layer
        # torch's recompute stops once it has what backward needs: the hook that offloads a weight accelerate loaded
        # for the layer's last submodule never ran, and that weight stayed on the device through backward and after
        self.early_stop = not offloads_weights(module)

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.use_reentrant and isinstance(function, functools.partial) and not _holds_tensors(function.args):
            # transformers binds the keywords (and on 5.2x the layer): they become the checkpoint's inputs below
            bound = functools.partial(function.func, *function.args) if function.args else function.func
            function, kwargs = bound, {**function.keywords, **kwargs}
        if self.offloader.holding:  # (read as a flag: under compile the call below breaks the graph)
            self.offloader.checkpoint_started()
        target = next((a for a in args if isinstance(a, torch.Tensor)), None)
        saving = self.offloader.hooks(self.index, target) if self.offload else contextlib.nullcontext()
        with saving:
            return self._checkpoint(self._recompute_aware(function), args, kwargs)

    def _recompute_aware(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """The first call of the checkpointed function is the forward; later calls are backward's
        recomputes, which fetch swapped weights first and leave the layer's buffers and counters as
        the forward left them (an MoE router's token counts must not grow twice)."""
        swapper, index, state, policy, calls = self.swapper, self.index, self.state, self.policy, [0]
        module, owed = self._module, OwedRecompute(swapper)

        def run(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling() and index not in swapper.schedule.layers:
                return function(*args, **kwargs)  # traced whole: backward recomputes it in the compiled graph
            calls[0] += 1
            layer = module()
            owing = _OWED.get(layer) if layer is not None else None
            if calls[0] == 1:
                if layer is not None:  # owed until its first recompute (`Controller._check_swap_change` asks)
                    (owing if owing is not None else _OWED.setdefault(layer, weakref.WeakSet())).add(owed)
                return state.watch_forward(function, *args, **kwargs)
            if owing is not None:
                owing.discard(owed)
            # remat's bookkeeping runs outside torch's dispatch modes ("selective" expects exactly the
            # forward's ops, and a memory measurement must not count weights as activations).
            around = contextlib.ExitStack()
            try:  # entered inside: one that fails to enter must not leave the other entered
                with _disable_current_modes():
                    around.enter_context(swapper.schedule.recomputing(index))
                    around.enter_context(state.kept())
                    around.enter_context(frozen_zero3_parameters_held(module()))
                return function(*args, **kwargs)
            except RuntimeError as err:
                explained = policy.explain_recompute_error(err, index)
                if explained is not None:
                    raise explained from err
                raise
            finally:
                with _disable_current_modes():
                    around.close()

        return run

    def _checkpoint(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rng = self.preserve_rng_state
        if not self.use_reentrant or distributed_training():
            options = {**self.options, "early_stop": self.early_stop}
            if kwargs:  # bound, not passed: torch's checkpoint would take a block's `debug=` or `early_stop=` itself
                function = functools.partial(function, **kwargs)
            return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=rng, **options)
        if kwargs:  # torch's reentrant checkpoint takes positional inputs only; tensors go as inputs (in a closure,
            # one that carries a graph, a learned bias, would be backpropagated through at every layer's recompute)
            function, args = _keyword_tensors_as_inputs(function, args, kwargs)
        if torch.is_grad_enabled() and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            first = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()), -1)
            args = tuple(a.detach().requires_grad_(True) if i == first else a for i, a in enumerate(args))
        output = checkpoint(function, *args, use_reentrant=True, preserve_rng_state=rng)
        if torch.is_grad_enabled() and _tensors_out_of_reach(output):
            raise ConfigError(
                f"use_reentrant=True: layer {self.index} returns a {type(output).__name__}, and torch's reentrant "
                "checkpoint carries gradients only out of a tensor or a tuple of tensors: the layer's weights would "
                "get none (or backward fails). Leave use_reentrant at its default (False)"
            )
        return output

    def __repr__(self) -> str:
        return (
            f"LayerCheckpoint(layer={self.index}, policy={self.policy.name}, offload={self.offload}, "
            f"use_reentrant={self.use_reentrant}, preserve_rng_state={self.preserve_rng_state})"
        )


def _holds_tensors(values: tuple[Any, ...]) -> bool:
    return any(torch.is_tensor(v) or (type(v) in (tuple, list) and _holds_tensors(tuple(v))) for v in values)


def _keyword_tensors_as_inputs(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`function` taking the keyword tensors (alone, or a tuple or list of them: rotary's `(cos, sin)`) after `args`,
    and the arguments to call it with: every tensor an input of the checkpoint."""
    spread = {
        k: v
        for k, v in kwargs.items()
        if torch.is_tensor(v) or (type(v) in (tuple, list) and v and all(torch.is_tensor(t) for t in v))
    }
    rest, count = {k: v for k, v in kwargs.items() if k not in spread}, len(args)
    shapes = [(k, None if torch.is_tensor(v) else (type(v), len(v))) for k, v in spread.items()]

    def call(*given: Any) -> Any:
        tensors, keywords = iter(given[count:]), dict(rest)
        for key, shape in shapes:
            keywords[key] = next(tensors) if shape is None else shape[0](next(tensors) for _ in range(shape[1]))
        return function(*given[:count], **keywords)

    flat = [t for v in spread.values() for t in ((v,) if torch.is_tensor(v) else v)]
    return call, (*args, *flat)


def _tensors_out_of_reach(output: Any) -> bool:
    """Whether a layer's output holds floating-point tensors only inside a dict, dataclass, list or nested sequence,
    none directly or in a tuple: those left torch's reentrant checkpoint without a graph."""
    if torch.is_tensor(output) or (isinstance(output, tuple) and any(torch.is_tensor(item) for item in output)):
        return False
    pending, seen = [output], 0
    while pending and seen < 10_000:
        item, seen = pending.pop(), seen + 1
        if torch.is_tensor(item):
            if item.is_floating_point():
                return True
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (tuple, list)):
            pending.extend(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            pending.extend(getattr(item, field.name, None) for field in dataclasses.fields(item))
    return False
