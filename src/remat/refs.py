"""`Ref`: how remat's own objects point at the model and its modules.

remat's state (the plan, the installers, the offloader and the swapper) refers to the model
weakly, and only the model's patches and hooks refer to remat's state. So no reference cycle
joins the two: a wrapper dropped with its model is freed at once by reference counting, host
memory (swapped weights' pinned copies) included, without waiting for a GC pass; and a model
whose wrapper was dropped keeps working, because its patches keep remat's state alive.

A `Ref` copies and pickles as a reference to the copy of its target, so `copy.deepcopy(cm)`
and `pickle` rebuild the same structure around the copied model.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, NoReturn, TypeVar

from .errors import StateError

T = TypeVar("T")


class Ref(Generic[T]):
    __slots__ = ("__weakref__", "_ref")

    def __init__(self, target: T):
        self._ref = weakref.ref(target)

    def __call__(self) -> T | None:
        return self._ref()

    def alive(self, gone: str) -> T:
        """The target, or a `StateError` (a RuntimeError) saying `gone` when it was freed while remat still used it."""
        target = self._ref()
        if target is None:
            raise StateError(f"remat: {gone}")
        return target

    def __reduce__(self) -> Any:
        target = self._ref()
        return (Ref, (target,)) if target is not None else (_dead, ())

    def __repr__(self) -> str:
        return f"Ref({type(self._ref()).__name__})"


class _Dead:
    def __call__(self) -> None:
        return None

    def alive(self, gone: str) -> NoReturn:
        raise StateError(f"remat: {gone}")


def _dead() -> _Dead:
    return _Dead()


class LocalRef(Ref[T]):
    """A weak reference that copies and pickles as a dead one: for the wrapper a model's state
    belongs to, which a copy of the model alone does not have."""

    __slots__ = ()

    def __reduce__(self) -> Any:
        return (_dead, ())
