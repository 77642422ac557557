"""An accelerator's streams played on the CPU, to test the transport's waits (`remat.transport.StreamTransport`)
without one. `FakeStreams` is the transport's `DeviceStreams` seam: a copy queued on a side stream is not done
but pending (its destination poisoned, NaN), and completes only when a wait or a synchronize needs it, or earlier
at random, always in an order the queued waits allow, picked by a seed. The compute stream runs eagerly: every
operation on it is seen by a `TorchDispatchMode`.

Every memory access (a copy queued on a side stream, an operation on the compute stream) is checked against the
waits with a vector clock per stream: a read must come after the last write to that memory, a write after every
access before it, by the stream order and the waits alone. So a missing wait is a race whatever order the copies
happen to complete in, and the seed varies the order in which the data really moves.

Memory is freed as a caching allocator frees it: device memory (allocated under the mode, on the stream current
then) that a side stream touched is watched, the fake holding its one extra reference, so it is freed when the
step drops its last one. The allocator may hand a freed block to the next allocation on the stream it was
allocated on at once; only `record_stream(tensor, stream)` makes it wait for the work queued on `stream` by then.
So at the free every access to that memory must be ordered before the owning stream and the recorded ones: a
source freed while its copy to the host may still read it, or a copy's result freed while the compute stream may
still read it, is a race. Host memory is pinned (the fake pins what is asked pinned under it): pinned memory's
own allocator waits for the copies that used it, so its frees are not checked."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

COMPUTE = "compute"
_METADATA = {torch.ops.aten.is_pinned.default}  # reads no data


@dataclass(eq=False)
class Copy:
    """A copy queued on a side stream, pending until completed (after everything it depends on)."""

    stream: str
    label: str
    run: Callable[[], Any] | None  # None: a wait, which moves no data
    deps: list[Copy] = field(default_factory=list)
    done: bool = False


class FakeStream:
    def __init__(self, device: FakeStreams, name: str):
        self.device, self.name = device, name

    def wait_stream(self, other: FakeStream) -> None:
        self.device.wait(self, f"wait_stream {other.name}", self.device.clocks[other.name], self.device.tip(other))

    def wait_event(self, event: FakeEvent) -> None:
        self.device.wait(self, f"wait_event {event.stream}", event.clock, event.copy)

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    def __init__(self, device: FakeStreams):
        self.device = device
        self.stream, self.clock, self.copy = "", {}, None

    def record(self, stream: FakeStream) -> None:
        self.stream, self.clock, self.copy = stream.name, dict(self.device.clocks[stream.name]), self.device.tip(stream)
        self.device.log.append(f"record {stream.name}")

    def synchronize(self) -> None:
        """The host blocks until the event's copies are done: all that any stream runs later comes after them."""
        self.device.log.append(f"synchronize {self.stream}")
        self.device.complete(self.copy)
        for name in self.device.clocks:
            self.device.clocks[name] = _join(self.device.clocks[name], self.clock)


def _join(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in a.keys() | b.keys()}


class FakeStreams(TorchDispatchMode):
    """The seam (`DeviceStreams`) and the memory checker; use it as a context around the step it checks."""

    def __init__(self, seed: int, progress: float = 0.3):
        super().__init__()
        self.rng, self.progress = random.Random(seed), progress
        self.compute = FakeStream(self, COMPUTE)
        self.current = self.compute
        self.clocks: dict[str, dict[str, int]] = {COMPUTE: {}}
        self.log: list[str] = []  # every stream and event call, in order
        self.races: list[str] = []
        self.pending: list[Copy] = []
        self._tips: dict[str, Copy | None] = {}
        self._history: dict[int, tuple[Any, list[Any]]] = {}  # storage -> (last write, reads since)
        # memory a side stream touched: the fake's one reference each, so it is never reused while the check runs
        self._kept: dict[int, torch.UntypedStorage] = {}
        self._owner: dict[int, str] = {}  # device memory allocated under the mode -> the stream it was allocated on
        self._pinned: set[int] = set()  # host memory
        self._watched: dict[int, str] = {}  # device memory a side stream touched, not freed yet -> its owner
        self._recorded: dict[int, set[str]] = {}  # storage -> the streams record_stream named for it

    # --- the seam -------------------------------------------------------------------------------------------
    def new_stream(self, device: torch.device) -> FakeStream:
        stream = FakeStream(self, f"side{len(self.clocks)}")
        self.clocks[stream.name] = {}
        return stream

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.compute

    @contextmanager
    def running_on(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def new_event(self, device: torch.device) -> FakeEvent:
        return FakeEvent(self)

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(f"record_stream {stream.name}")
        self._recorded.setdefault(_key(tensor), set()).add(stream.name)

    # --- streams ----------------------------------------------------------------------------------------------
    def tip(self, stream: FakeStream) -> Copy | None:
        return self._tips.get(stream.name)

    def wait(self, stream: FakeStream, what: str, clock: dict[str, int], after: Copy | None) -> None:
        self.collect_freed()
        self.log.append(f"{stream.name} {what}")
        self.clocks[stream.name] = _join(self.clocks[stream.name], clock)
        if stream is self.compute:  # it runs eagerly: what it waits for completes now
            self.complete(after)
        elif after is not None:
            self._queue(Copy(stream.name, what, None, [after]))
        self._progress()

    def _queue(self, copy: Copy) -> None:
        previous = self._tips.get(copy.stream)
        copy.deps += [previous] if previous is not None else []
        self._tips[copy.stream] = copy
        self.pending.append(copy)

    def complete(self, copy: Copy | None) -> None:
        """`copy` and everything it waits for complete, in an order the seed picks among those the waits allow."""
        if copy is None or copy.done:
            return
        for dep in self.rng.sample(copy.deps, len(copy.deps)):
            self.complete(dep)
        if copy.run is not None:
            with _disable_current_modes():
                copy.run()
        copy.done = True
        self.pending.remove(copy)

    def _progress(self) -> None:
        """Some pending copies complete early, as on a device that runs ahead."""
        for copy in self.rng.sample(self.pending, len(self.pending)):
            if self.rng.random() < self.progress:
                self.complete(copy)

    def finish(self) -> None:
        self.collect_freed()
        while self.pending:
            self.complete(self.pending[0])

    # --- memory -----------------------------------------------------------------------------------------------
    def _keep(self, tensors: Any) -> None:
        """A side stream touches these: kept from reuse; device memory among them is watched for its free."""
        for tensor in tree_leaves(list(tensors)):
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                key = _key(tensor)
                if key not in self._kept:
                    self._kept[key] = tensor.untyped_storage()
                    if key in self._owner:
                        self._watched[key] = self._owner[key]

    def collect_freed(self) -> None:
        """Watched memory only the fake still holds was freed: its owning stream may reuse it from now on, and
        the streams record_stream named for it from the end of the work queued on them by now."""
        for key, owner in list(self._watched.items()):
            if torch._C._storage_Use_Count(self._kept[key]._cdata) > 1:
                continue
            del self._watched[key]
            recorded = self._recorded.pop(key, set())
            reuse = dict(self.clocks[owner])
            for name in recorded:
                reuse = _join(reuse, self.clocks[name])
            write, reads = self._history.get(key, (None, []))
            for earlier in [write, *reads]:
                if earlier is not None and reuse.get(earlier[0], 0) < earlier[1]:
                    self.races.append(
                        f"memory freed while {earlier[2]} on {earlier[0]} may still use it: {owner} may reuse it "
                        f"at once (record_stream named {sorted(recorded) or 'no stream'})"
                    )

    def _allocated(self, stream: str, tensors: list[Any], pinned: bool) -> None:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                key = _key(tensor)
                self._pinned.discard(key)
                self._owner.pop(key, None)
                if pinned:
                    self._pinned.add(key)
                else:
                    self._owner[key] = stream

    def _access(self, stream: str, label: str, reads=(), writes=(), fresh=()) -> None:
        clock = self.clocks[stream]
        clock[stream] = clock.get(stream, 0) + 1
        me = (stream, clock[stream], label)

        def after(earlier: Any) -> bool:
            return earlier is None or clock.get(earlier[0], 0) >= earlier[1]

        for key in _storages(reads):
            write, reads_since = self._history.setdefault(key, (None, []))
            if not after(write):
                self.races.append(f"{label} on {stream} read what {write[2]} on {write[0]} writes, unordered")
            reads_since.append(me)
        for key in _storages(writes):
            write, reads_since = self._history.get(key, (None, []))
            for earlier in [write, *reads_since]:
                if not after(earlier):
                    self.races.append(f"{label} on {stream} wrote what {earlier[2]} on {earlier[0]} uses, unordered")
            self._history[key] = (me, [])
        for key in _storages(fresh):
            self._history[key] = (me, [])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        self.collect_freed()
        stream, label = self.current.name, str(func)
        if func is torch.ops.aten.is_pinned.default:
            return _key(args[0]) in self._pinned
        if stream != COMPUTE and func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            self._access(stream, f"copy on {stream}", reads=[src], writes=[dst])
            self._keep([dst, src])
            poison = float("nan") if dst.is_floating_point() else torch.iinfo(dst.dtype).max
            dst.fill_(poison)  # what a reader sees before the copy completes (NaN, as uint8 bytes too)
            # the pending copy holds no tensor (it would keep the memory from being freed), only the fake's storages
            to, of = self._view_of(dst), self._view_of(src)
            self._queue(Copy(stream, label, lambda: to().copy_(of())))
            self._progress()
            return dst
        pinned = bool(kwargs.pop("pin_memory", False))  # the emulated accelerator can pin host memory
        out = func(*args, **kwargs)
        if func in _METADATA or any(
            r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
        ):
            return out  # a view: no data moves
        reads, writes = [], []
        for position, argument in enumerate(func._schema.arguments):
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            is_write = argument.alias_info is not None and argument.alias_info.is_write
            (writes if is_write else reads).extend(tree_leaves(value))
        fresh = [o for r, o in zip(func._schema.returns, _as_tuple(out), strict=False) if r.alias_info is None]
        self._allocated(stream, fresh, pinned)
        if stream != COMPUTE:
            self._keep(fresh)
        self._access(stream, label, reads, writes, fresh)
        return out

    def _view_of(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        storage, dtype = self._kept[_key(tensor)], tensor.dtype
        offset, size, stride = tensor.storage_offset(), tensor.shape, tensor.stride()
        return lambda: torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


def _as_tuple(out: Any) -> tuple:
    return out if isinstance(out, tuple | list) else (out,)


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _storages(values: Any) -> set[int]:
    return {_key(v) for v in tree_leaves(list(values)) if isinstance(v, torch.Tensor) and v.numel()}
