"""The recompute shim: what a checkpointed layer calls instead of running its forward directly.

transformers' `GradientCheckpointingLayer` calls ``layer._gradient_checkpointing_func(fn, *args)``
when its `gradient_checkpointing` flag is set and it is training (from `__call__` before 5.23,
from `forward` since). remat sets that flag and function per layer, on the instance, as its map
says. Keyword arguments of the layer (masks, position embeddings) arrive bound into `fn`; the
positional ones (hidden states) are what the checkpoint saves.

Holders (modules that only carry the flag so transformers turns `use_cache` off) get
`run_without_checkpoint`, so they can never add a checkpoint around a layer that has its own:
no layer is checkpointed twice.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from .snapshot import Watched

if TYPE_CHECKING:
    from .offload import Offloader
    from .policies import Policy
    from .swap import WeightSwapper

logger = logging.getLogger("remat")


def run_without_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The holder's function: run as is. Checkpointing is decided by each layer, not its parent."""
    return function(*args, **kwargs)


def _outside_dispatch_modes() -> contextlib.AbstractContextManager[Any]:
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _needs_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


class _LayerState:
    """The buffers and numeric attributes of a layer that its forward changes (an MoE router's
    token counts, a step counter), so the recompute can leave them as the forward did.

    Only what the forward actually changed is copied and written back (`remat.snapshot`):
    writing back every buffer would bump version counters that a reentrant backward checks
    (rotary caches read through views), and would clone large caches on every recompute.
    """

    def __init__(self, module: nn.Module):
        # The shim lives on the layer, so the snapshot names the layer's modules weakly.
        self.watched = Watched(module.modules())
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


def _distributed() -> bool:
    """Whether several processes train together. Reentrant checkpointing runs a separate backward
    per layer, which DDP sees as parameters marked ready twice ("Expected to mark a variable
    ready only once"); non-reentrant checkpointing gives the same gradients without that, so it
    is used whenever torch.distributed runs with more than one process (said once)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    if "reentrant" not in _told:
        _told.add("reentrant")
        logger.info(
            "use_reentrant=True is ignored while torch.distributed runs several processes: "
            "remat checkpoints non-reentrantly (same gradients, and DDP can mark each parameter once)"
        )
    return True


class LayerCheckpoint:
    """Checkpoint one layer as its policy says (`remat.policies`): keep its inputs (on the device,
    or in host memory when the plan offloads them), drop its activations, or with "selective"
    only those of cheap ops, and recompute them in backward.

    Non-reentrant by default (torch's recommendation; it follows gradients into keyword
    arguments and supports nested autograd). With `use_reentrant=True`, a layer whose inputs do
    not require grad (a frozen embedding under LoRA) would produce an output with no grad_fn and
    its LoRA weights would never learn; the first floating-point input is then detached and made
    to require grad, which costs one extra gradient and needs no hook on the embedding.
    """

    def __init__(
        self,
        index: int,
        policy: Policy,
        *,
        use_reentrant: bool,
        preserve_rng_state: bool,
        offloader: Offloader | None = None,
        offload: bool = False,
        swapper: WeightSwapper | None = None,
        module: nn.Module | None = None,
    ):
        self.index = index
        self.policy = policy
        self.use_reentrant = use_reentrant  # CheckpointConfig refuses it for policies that need non-reentrant
        self.options = policy.checkpoint_options(index)
        self.preserve_rng_state = preserve_rng_state
        self.offloader = offloader
        self.offload = offload and offloader is not None
        # Asked at recompute time, not now: the swapped set may change between forward and backward.
        self.swapper = swapper
        self.state = _LayerState(module) if module is not None else None

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.offloader is not None:
            self.offloader.checkpoint_started()
        # The checkpoint saves its positional inputs before it enters its own hooks, so these
        # hooks see exactly the layer's inputs (see remat.offload).
        if self.offload:
            target = next((a for a in args if isinstance(a, torch.Tensor)), None)
            saving = self.offloader.hooks(self.index, target)
        else:
            saving = contextlib.nullcontext()
        with saving:
            return self._checkpoint(self._recompute_aware(function), args, kwargs)

    def _recompute_aware(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """The first call of the checkpointed function is the forward; later calls are backward's
        recomputes. A recompute fetches swapped weights first, and leaves the layer's buffers and
        counters as the forward left them (an MoE router's token counts must not grow twice)."""
        swapper, index, state, policy, calls = self.swapper, self.index, self.state, self.policy, [0]

        def run(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                return state.watch_forward(function, *args, **kwargs) if state else function(*args, **kwargs)
            # Fetching swapped weights and saving the layer's counters are remat's bookkeeping, not
            # the layer's computation: they run outside torch's dispatch modes (the "selective"
            # policy's recompute expects exactly the forward's ops, and a memory measurement must
            # not count weights as activations).
            around = contextlib.ExitStack()
            try:  # entered inside: one that fails to enter must not leave the other entered
                with _outside_dispatch_modes():
                    if swapper is not None:
                        around.enter_context(swapper.recomputing(index))
                    if state is not None:
                        around.enter_context(state.kept())
                return function(*args, **kwargs)
            except RuntimeError as err:
                explained = policy.explain_recompute_error(err, index)
                if explained is not None:
                    raise explained from err
                raise
            finally:
                with _outside_dispatch_modes():
                    around.close()

        return run

    def _checkpoint(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.use_reentrant and not _distributed():
            if kwargs:
                # torch's reentrant checkpoint takes positional inputs only.
                bound, kwargs = function, dict(kwargs)
                function = lambda *a: bound(*a, **kwargs)
            if torch.is_grad_enabled() and not any(_needs_grad(a) for a in args):
                args = self._first_float_requires_grad(args)
            return checkpoint(function, *args, use_reentrant=True, preserve_rng_state=self.preserve_rng_state)
        return checkpoint(
            function, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state, **self.options, **kwargs
        )

    @staticmethod
    def _first_float_requires_grad(args: tuple[Any, ...]) -> tuple[Any, ...]:
        out = list(args)
        for i, value in enumerate(out):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                out[i] = value.detach().requires_grad_(True)
                break
        return tuple(out)

    def __repr__(self) -> str:
        return (
            f"LayerCheckpoint(layer={self.index}, policy={self.policy.name}, offload={self.offload}, "
            f"use_reentrant={self.use_reentrant}, "
            f"preserve_rng_state={self.preserve_rng_state})"
        )
