"""The transformers routes that turn checkpointing on and off, redirected into the map.

`gradient_checkpointing_enable` / `activation_checkpointing_enable` and their `_disable` twins
are replaced on the wrapped model's `PreTrainedModel` instances (never on a class), so every
caller (user code, Trainer, PEFT's `prepare_model_for_kbit_training`, TRL's generation toggles)
ends up changing remat's config and map and nothing else. `disable()` puts the originals back.

What a route call means:
- the options it may carry are `every_n_layers`, `offload`, `use_reentrant` and
  `preserve_rng_state`, as keywords or as keys of the kwargs dict; anything else is an error,
  never passed silently into layer calls;
- a value equal to remat's default (`every_n_layers=1`, `offload=False`, ...) expresses no
  wish: Trainer and PEFT pass those on every call, so they keep the wrapper's config;
- a non-default value updates the config, and the change is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..config import CheckpointConfig
from ..install import InstancePatches
from .transformers_compat import ENABLE_ROUTES, pretrained_model_class, routes_defined_on

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger("remat")

ROUTE_OPTIONS = ("every_n_layers", "offload", "use_reentrant", "preserve_rng_state")
_DEFAULTS = CheckpointConfig()


def _is_default(key: str, value: Any) -> bool:
    default = getattr(_DEFAULTS, key)
    return type(value) is type(default) and value == default


def config_from_route(
    current: CheckpointConfig,
    route: str,
    kwargs_dict: Mapping[str, Any] | None,
    keywords: Mapping[str, Any],
) -> CheckpointConfig:
    """The config a route call asks for, starting from `current`. Raises before anything changes."""
    if kwargs_dict is not None and not isinstance(kwargs_dict, Mapping):
        raise TypeError(f"{route}: the checkpointing kwargs must be a dict, got {type(kwargs_dict).__name__}")
    options = dict(kwargs_dict or {})
    for key, value in keywords.items():
        if key in options and not _is_default(key, value) and options[key] != value:
            raise ValueError(f"{route}: {key} is given twice with different values ({options[key]!r} and {value!r})")
        if key not in options or not _is_default(key, value):
            options[key] = value
    unknown = sorted(set(options) - set(ROUTE_OPTIONS))
    if unknown:
        raise ValueError(
            f"{route}: remat does not know the checkpointing option(s) {unknown}; it accepts {list(ROUTE_OPTIONS)}. "
            "Nothing was changed. (Other torch.utils.checkpoint options are not supported, and remat never passes "
            "unknown keys into layer calls.)"
        )
    changes = {key: value for key, value in options.items() if not _is_default(key, value)}
    try:
        return current.replace(**changes)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{route}: {err}") from None


def describe_changes(old: CheckpointConfig, new: CheckpointConfig) -> str:
    return ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in old.changed_fields(new).items())


class RouteOverrides:
    """Instance-level replacements of the enable/disable routes, and how to undo them."""

    def __init__(
        self,
        on_enable: Callable[[str, Mapping[str, Any] | None, dict[str, Any]], None],
        on_disable: Callable[[str], None],
    ):
        self._on_enable = on_enable
        self._on_disable = on_disable
        self._patches = InstancePatches()

    def install(self, model: nn.Module) -> None:
        pretrained = pretrained_model_class()
        targets = [m for m in model.modules() if isinstance(m, pretrained)]
        for module in targets:
            for name in routes_defined_on(module):
                maker = self._enable_route if name in ENABLE_ROUTES else self._disable_route
                self._patches.set(module, name, maker(name))

    def uninstall(self) -> None:
        self._patches.undo()

    def _enable_route(self, route: str) -> Callable[..., None]:
        kwargs_name = route.replace("_enable", "_kwargs")
        on_enable = self._on_enable

        def enable(*args: Any, every_n_layers: int = 1, offload: bool = False, **kwargs: Any) -> None:
            if len(args) > 1:
                raise TypeError(f"{route}() takes at most one positional argument ({kwargs_name}), got {len(args)}")
            if args and kwargs_name in kwargs:
                raise TypeError(f"{route}() got {kwargs_name} twice")
            kwargs_dict = args[0] if args else kwargs.pop(kwargs_name, None)
            if kwargs:
                raise TypeError(
                    f"{route}() got unexpected argument(s) {sorted(kwargs)}; it takes {kwargs_name}, "
                    "every_n_layers and offload"
                )
            on_enable(f"{route}()", kwargs_dict, {"every_n_layers": every_n_layers, "offload": offload})

        enable.__name__ = route
        enable.__doc__ = f"remat: `{route}` changes the checkpoint map of the CheckpointedModel that owns this model."
        # PEFT inspects the signature for this parameter name before passing the dict.
        enable.__signature__ = _enable_signature(kwargs_name)  # type: ignore[attr-defined]
        return enable

    def _disable_route(self, route: str) -> Callable[[], None]:
        on_disable = self._on_disable

        def disable() -> None:
            on_disable(f"{route}()")

        disable.__name__ = route
        disable.__doc__ = f"remat: `{route}` turns every layer of the checkpoint map to 'none'."
        return disable


def _enable_signature(kwargs_name: str):  # type: ignore[no-untyped-def]
    import inspect

    P = inspect.Parameter
    return inspect.Signature(
        [
            P(kwargs_name, P.POSITIONAL_OR_KEYWORD, default=None),
            P("every_n_layers", P.KEYWORD_ONLY, default=1),
            P("offload", P.KEYWORD_ONLY, default=False),
        ]
    )
