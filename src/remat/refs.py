"""How remat points at the model (`Ref`) and what it sets on its instances (`InstancePatches`).

remat's state refers to the model weakly, and only the model's patches and hooks refer to remat's
state. No reference cycle: a dropped wrapper and model are freed at once (pinned memory too), and a
model whose wrapper was dropped keeps working. A `Ref` copies and pickles as a reference to the copy
of its target, so `copy.deepcopy(cm)` and pickle rebuild the same structure."""

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


class _Missing:
    """An attribute absent before remat set it: one object, in copies and pickles too (`undo()`
    compares by identity)."""

    def __reduce__(self) -> str:
        return "MISSING"

    def __repr__(self) -> str:
        return "<absent>"


MISSING = _Missing()


def restore_attributes(module: Any, saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        if value is MISSING:
            module.__dict__.pop(key, None)
        else:
            object.__setattr__(module, key, value)


class InstancePatches:
    """Attributes set on single instances, targets held weakly, remembered so `undo()` puts each
    back as it was. One that other code replaced since (TRL wraps `gradient_checkpointing_enable`
    around remat's route) stays as that code set it; remat's value it wrapped must then behave once
    remat let go (routes forward to the model's current method)."""

    def __init__(self) -> None:
        # The value set is remembered by id: holding it would make a cycle through patches that
        # refer to their owner, and while it stays set the id is its own.
        self._saved: list[tuple[Ref[Any], str, Any, int]] = []

    def set(self, target: Any, name: str, value: Any) -> None:
        self._saved.append((Ref(target), name, target.__dict__.get(name, MISSING), id(value)))
        object.__setattr__(target, name, value)  # kept out of nn.Module's parameter/buffer bookkeeping

    def undo(self) -> None:
        for ref, name, previous, value_id in reversed(self._saved):
            target = ref()
            if target is not None and id(target.__dict__.get(name, MISSING)) == value_id:
                restore_attributes(target, {name: previous})
        self._saved.clear()
