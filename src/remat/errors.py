"""Every error remat raises to a user: `RematError` and its subclasses, importable from `remat`.

Each class is also the builtin a caller caught before the family existed (`except ValueError`
keeps working), and each message names what to do. This module imports nothing of remat, so
every room can raise from it.
"""

from __future__ import annotations


class RematError(Exception):
    """The base of every error remat raises: `except remat.RematError` catches them all."""


class ConfigError(RematError, ValueError):
    """A value remat cannot use: a CheckpointConfig field, a wrapper or planning argument, a size
    or budget, a map the model cannot take."""


class ConfigTypeError(RematError, TypeError):
    """A value of the wrong type where remat takes a setting or an argument, or a call on the wrong
    kind of object (a model that is not a torch module, a Trainer remat cannot train)."""


class StateError(RematError, RuntimeError):
    """A call the wrapper or its model cannot take in their present state; the message names what
    to call first."""


class PolicyError(RematError, RuntimeError):
    """A layer does what its checkpoint policy cannot run (with "selective": an in-place change of
    an output the policy keeps); the message names the layer and the policy to give it instead."""


class SavedFileError(RematError, ValueError):
    """A saved file or folder remat cannot read or that does not fit the model: not JSON, a field
    of the wrong form, a FIFO where a file belongs, another architecture."""


class NotSavedError(RematError, FileNotFoundError):
    """No checkpoint config (or no saved wrapper) where one was asked for."""


class FolderChangedError(SavedFileError):
    """A file of the folder changed while it was being loaded: load again."""


class LockFileError(RematError, OSError):
    """Something that is not a regular file (a symlink, a FIFO, a folder) where remat's lock file
    goes: remat did not make it and does not open it."""


class NoCheckpointableLayersError(RematError, ValueError):
    """The model has no layers remat can checkpoint; the message names what was searched for."""


class BlockSwapError(RematError, ValueError):
    """A layer asked for in `swap_layers` cannot be swapped; refused before anything moves."""


class ReplacedWrapperError(StateError):
    """Another wrapper has taken this wrapper's model since; use that one or re-wrap."""


class StaleProfileError(RematError, ValueError):
    """The model changed since it was profiled (layers, trainable weights, swap, measured fields):
    profile again."""
