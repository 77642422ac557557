"""How remat points at the model (`Ref`) and what it sets on its instances (`InstancePatches`). remat's state
refers to the model weakly, only the model's patches and hooks refer to it: no reference cycle (README, "Copies,
modes and faults"). A `Ref` copies and pickles as one to its target's copy, so deepcopy and pickle rebuild it."""

from __future__ import annotations

import copy
import weakref
from typing import Any, Generic, TypeVar

from .errors import StateError

T = TypeVar("T")


class Ref(Generic[T]):
    """A weak reference; `Ref(None)` is a dead one (what a reference to a freed target pickles as)."""

    __slots__ = ("__weakref__", "_ref")

    def __init__(self, target: T | None):
        self._ref = (lambda: None) if target is None else weakref.ref(target)

    def __call__(self) -> T | None:
        return self._ref()

    def alive(self, gone: str) -> T:
        """The target, or a `StateError` (a RuntimeError) saying `gone` when it was freed while remat still used it."""
        if (target := self._ref()) is None:
            raise StateError(f"remat: {gone}")
        return target

    def __reduce__(self) -> Any:
        return (Ref, (self._ref(),))


class LocalRef(Ref[T]):
    """A weak reference that copies and pickles as a dead one: for the wrapper, which a model's copy lacks."""

    __slots__ = ()

    def __reduce__(self) -> Any:
        return (Ref, (None,))


class _Missing:
    """An attribute absent before remat set it: one object in copies and pickles too (`undo()` compares `is`)."""

    def __reduce__(self) -> str:
        return "MISSING"


MISSING = _Missing()


def restore_attributes(module: Any, saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        if value is MISSING:
            module.__dict__.pop(key, None)
        else:
            object.__setattr__(module, key, value)


class InstancePatches:
    """Attributes set on single instances, targets held weakly, so `undo()` puts each back. One that other
    code replaced since (TRL wraps `gradient_checkpointing_enable`) stays, and remat's value it wrapped must
    behave once remat let go (routes forward to the model's current method)."""

    def __init__(self) -> None:
        # The value set is remembered by id: holding it would make a cycle; while it stays set, the id is its own.
        self._saved: list[tuple[Ref[Any], str, Any, int]] = []

    def set(self, target: Any, name: str, value: Any) -> None:
        self._saved.append((Ref(target), name, target.__dict__.get(name, MISSING), id(value)))
        object.__setattr__(target, name, value)  # kept out of nn.Module's parameter/buffer bookkeeping

    @staticmethod
    def _still_set(ref: Ref[Any], name: str, value_id: int) -> Any:
        """remat's value where it is still set; `MISSING` where other code replaced it or the target is gone."""
        target = ref()
        value = MISSING if target is None else target.__dict__.get(name, MISSING)
        return value if id(value) == value_id else MISSING

    def __deepcopy__(self, memo: dict[int, Any]) -> InstancePatches:
        """A copy that undoes on the copied targets: the ids it remembers are those of the copied values."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items() if k != "_saved"})
        copied._saved = []
        for ref, name, previous, value_id in self._saved:
            target = ref()
            if target is None:
                continue
            twin = copy.deepcopy(target, memo)  # may be half-built here: its value is found through memo
            value = self._still_set(ref, name, value_id)
            twin_id = 0 if value is MISSING else id(copy.deepcopy(value, memo))
            copied._saved.append((Ref(twin), name, copy.deepcopy(previous, memo), twin_id))
        return copied

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with the values still set, not their ids (a loaded value has another): pickle loads each as the
        very object its loaded target holds, so `__setstate__` remembers the loaded ids and `undo()` finds them."""
        state = dict(self.__dict__)
        state["_saved"] = [(ref, n, previous, self._still_set(ref, n, i)) for ref, n, previous, i in self._saved]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Back to ids once loaded (the values held would make a cycle); 0, no object's id, for a replaced one."""
        saved = state.pop("_saved")
        self.__dict__.update(state)
        self._saved = [(ref, n, previous, 0 if v is MISSING else id(v)) for ref, n, previous, v in saved]

    def undo(self) -> None:
        for ref, name, previous, value_id in reversed(self._saved):
            if self._still_set(ref, name, value_id) is not MISSING:  # (its target is alive then)
                restore_attributes(ref(), {name: previous})
        self._saved.clear()
