"""Every error remat raises to a user; each is also the builtin a caller caught before (`except ValueError`)."""

from dataclasses import FrozenInstanceError


class RematError(Exception):
    """The base of every error remat raises: `except remat.RematError` catches them all."""


class ConfigError(RematError, ValueError):
    """A value remat cannot use: a config field, an argument, a size or budget, a map the model cannot take."""


class ConfigTypeError(RematError, TypeError):
    """A value of the wrong type for a setting or argument, or a call on an object remat refuses it for."""


class FrozenConfigError(RematError, FrozenInstanceError):
    """An assignment to a `CheckpointConfig` field or to `cm.checkpoint_config` (an AttributeError, as before)."""


class StateError(RematError, RuntimeError):
    """A call the wrapper or its model cannot take in their present state; the message names what to call first."""


class PolicyError(RematError, RuntimeError):
    """A layer does what its checkpoint policy cannot run ("selective": an in-place change of a kept output).
    `layer` and `op`: the layer refused and the op that changed a kept output (when known), for the profile,
    which leaves "selective" out for that layer instead of failing."""

    def __init__(self, message: str, *, layer: int | None = None, op: str = ""):
        super().__init__(message)
        self.layer, self.op = layer, op


class SavedFileError(RematError, ValueError):
    """A saved file or folder remat cannot read, or that does not fit the model."""


class NotSavedError(RematError, FileNotFoundError):
    """No checkpoint config (or no saved wrapper) where one was asked for."""


class FolderChangedError(SavedFileError):
    """A file of the folder changed while it was being loaded (or the folder mixes two saves)."""


class FolderAccessError(RematError, PermissionError):
    """A folder the OS refuses to save into or load from (permissions, a read-only mount): named with the OS's reason;
    nothing was written. (The OS's error named remat's hidden staging folder or lock file, never the user's folder.)"""


class LockFileError(RematError, OSError):
    """Something that is not a regular file where remat's lock file goes: remat does not open it."""


class NoCheckpointableLayersError(RematError, ValueError):
    """The model has no layers remat can checkpoint; the message names what was searched for."""


class BlockSwapError(RematError, ValueError):
    """A layer asked for in `swap_layers` cannot be swapped; refused before anything moves."""


class ReplacedWrapperError(StateError):
    """Another wrapper has taken this wrapper's model since; use that one or wrap again."""


class StaleProfileError(RematError, ValueError):
    """The model changed since it was profiled: profile again."""
