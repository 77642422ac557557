"""Attributes remat sets on single instances (never on a class), and how they are undone."""

from __future__ import annotations

from typing import Any

from .refs import Ref


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
