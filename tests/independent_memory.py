"""Memory counts for the tests that share neither code nor method with remat's own: what the
planner and the report claim is checked against these.

- `held_bytes(model, batch)`: the bytes of activations held for backward after forward, as the
  allocator counts them. remat counts with a dispatch mode (`remat.measure.LiveStorages`: op
  outputs still alive after forward, each storage once); this asks the memory allocator itself,
  through torch's profiler (`profile_memory=True`), which records every allocation and free of
  the CPU allocator with its address: the blocks allocated during forward and not freed when it
  returns are what forward left behind, whoever made them (torch 2.13 has no CPU allocator
  statistics to read instead; on CUDA, `torch.cuda.memory_allocated` would be the same count).
  It sees what a dispatch mode cannot: tensors made outside the dispatcher. Two such are known
  and named by `remat_blind_spots`: the CPU RNG state torch's checkpoint keeps per checkpointed
  layer (`torch.get_rng_state()`, to replay dropout) and each Python scalar autograd saves as a
  0-dim tensor (eager attention's `* scaling`: 8 bytes per layer).
- `step_peak_bytes(model, batch, optimizer)`: the peak of one whole training step (forward,
  backward, optimizer step) as torch's own `MemTracker` counts it.
"""

from __future__ import annotations

import gc

import torch
from torch.profiler import ProfilerActivity, profile

from remat.model import controller_of

SAVED_SCALAR_BYTES = 8  # a Python float autograd saves for backward, as a 0-dim float64 tensor


def held_bytes(model, batch, loss_of=lambda out, batch: out.loss) -> int:
    """One training step; the bytes the CPU allocator handed out during forward and has not got
    back when forward returns (see the module docstring). Gradients are cleared afterwards.

    The collection inside the window frees the reference cycles forward left; what existed before forward is
    frozen out of its sight (it allocated nothing in the window, so its frees change no count), and a collection
    takes milliseconds, not the 0.2-0.3 s of walking every object of a process that imported transformers."""
    frozen_here = not gc.get_freeze_count()  # a caller's own freeze is left as it is
    if frozen_here:
        gc.freeze()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = loss_of(model(**batch), batch)
            gc.collect()
    finally:
        if frozen_here:
            gc.unfreeze()
    live = {}
    for event in sorted(_allocations(prof.profiler.kineto_results.experimental_event_tree()), key=_start):
        fields = event.extra_fields
        if fields.alloc_size > 0:
            live[fields.ptr] = fields.alloc_size
        else:
            live.pop(fields.ptr, None)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(live.values())


def _allocations(events):
    for event in events:
        if event.tag == torch._C._profiler._EventType.Allocation:
            yield event
        yield from _allocations(event.children)


def _start(event):
    return event.start_time_ns


def remat_blind_spots(cm, saved_scalars_per_layer: int = 1) -> int:
    """What forward leaves on a CPU model that remat's count does not see (made outside the
    dispatcher): the CPU RNG state each checkpointed layer keeps, and the Python scalars autograd
    saves (one per layer in eager attention)."""
    controller = controller_of(cm)
    checkpointed = len(controller.checkpoint_map.checkpointed) if controller.is_enabled else 0
    rng = torch.get_rng_state().nbytes if controller.config.preserve_rng_state else 0
    layers = len(controller.checkpoint_map)
    return checkpointed * rng + layers * saved_scalars_per_layer * SAVED_SCALAR_BYTES


def activation_bytes(cm, batch, loss_of=lambda out, batch: out.loss) -> int:
    """`held_bytes` less the CPU RNG states of the checkpointed layers: the activations the
    planner predicts (it leaves out the RNG states, which live in host memory on an accelerator;
    the few bytes of saved scalars are within every test's tolerance)."""
    return held_bytes(cm, batch, loss_of) - remat_blind_spots(cm, saved_scalars_per_layer=0)


class _NoHook:
    def remove(self):
        pass


def step_peak_bytes(model, batch, optimizer, loss_of=lambda out, batch: out.loss) -> int:
    """The peak of one training step with the optimizer's step, as MemTracker counts it (model,
    optimizer and batch tracked). Leaves the step taken (the caller restores what it needs)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer, *[v for v in batch.values() if isinstance(v, torch.Tensor)])
    with tracker:
        # torch 2.13's MemTracker hooks every parameter's gradient; frozen ones refuse a hook
        for p in model.parameters():
            if not p.requires_grad:
                tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        loss = loss_of(model(**batch), batch)
        loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    snapshot = tracker.get_tracker_snapshot("peak")
    return int(sum(counts["Total"] for counts in snapshot.values()))
