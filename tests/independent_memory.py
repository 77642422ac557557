"""Memory counts for the tests that share no code with remat (`remat.measure`, `remat.report`,
`remat.planner`): what the planner and the report claim is checked against these.

- `held_bytes(model, batch)`: the bytes of activations held for backward after forward. A
  TorchDispatchMode written here keeps a weak reference to every tensor an op returns during
  forward; after forward, the storages still alive (each counted once, parameters' and buffers'
  excluded) are what the autograd graph and the loss keep.
- `step_peak_bytes(model, batch, optimizer)`: the peak of one whole training step (forward,
  backward, optimizer step) as torch's own `MemTracker` counts it.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Outputs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


def _storage(t):
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return s.data_ptr(), s.nbytes()


def held_bytes(model, batch, loss_of=lambda out, batch: out.loss) -> int:
    """One training step; the activation bytes alive after forward (see the module docstring).
    Gradients are cleared afterwards."""
    weights = {_storage(t)[0] for t in (*model.parameters(), *model.buffers())}
    mode = _Outputs()
    with mode:
        loss = loss_of(model(**batch), batch)
    gc.collect()
    seen = {}
    for ref in mode.refs:
        t = ref()
        key = None if t is None else _storage(t)
        if key is not None and key[0] not in weights and key[0] != 0:
            seen[key[0]] = max(seen.get(key[0], 0), key[1])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


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
