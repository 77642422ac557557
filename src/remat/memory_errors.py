"""The errors that are also torch's `OutOfMemoryError` (a retry loop's `except torch.OutOfMemoryError` and accelerate's
batch-size finder take them): apart from `remat.errors`, which imports no torch (`import remat` stays free of it)."""

import torch

from .errors import ConfigError, StateError


class OutOfMemoryError(StateError, torch.OutOfMemoryError):
    """A profile's step ran out of device memory even with every layer recomputed: no map fits that batch. Also
    torch's `OutOfMemoryError`, whose message it keeps saying (" out of memory."), so a retry loop's `except
    torch.OutOfMemoryError` and accelerate's batch-size finder (Trainer's `auto_find_batch_size=True`) shrink the
    batch; torch's error is its `__cause__`."""


class BudgetExceededError(ConfigError, torch.OutOfMemoryError):
    """A step that fits no map under the budget, where fewer rows of its length do (the message says which): a
    ValueError as every budget refusal, and torch's `OutOfMemoryError` too, so Trainer's `auto_find_batch_size=True`
    shrinks the batch as it would for the device's own."""
