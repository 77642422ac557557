"""`Ref`: how remat's own objects point at the model and its modules.

remat's state refers to the model weakly, and only the model's patches and hooks refer to remat's
state: no reference cycle, so a wrapper dropped with its model is freed at once (pinned host memory
included), and a model whose wrapper was dropped keeps working. A `Ref` copies and pickles as a
reference to the copy of its target, so `copy.deepcopy(cm)` and pickle rebuild the same structure.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

from .errors import StateError

T = TypeVar("T")


def _gone() -> None:
    return None


class Ref(Generic[T]):
    """A weak reference; `Ref(None)` is a dead one (what a reference to a freed target pickles as)."""

    __slots__ = ("__weakref__", "_ref")

    def __init__(self, target: T | None):
        self._ref = _gone if target is None else weakref.ref(target)

    def __call__(self) -> T | None:
        return self._ref()

    def alive(self, gone: str) -> T:
        """The target, or a `StateError` (a RuntimeError) saying `gone` when it was freed while remat still used it."""
        target = self._ref()
        if target is None:
            raise StateError(f"remat: {gone}")
        return target

    def __reduce__(self) -> Any:
        return (Ref, (self._ref(),))

    def __repr__(self) -> str:
        return f"Ref({type(self._ref()).__name__})"


class LocalRef(Ref[T]):
    """A weak reference that copies and pickles as a dead one: for the wrapper a model's state
    belongs to, which a copy of the model alone does not have."""

    __slots__ = ()

    def __reduce__(self) -> Any:
        return (Ref, (None,))
