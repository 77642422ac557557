"""transformers' checkpointing routes replaced on the model's `PreTrainedModel` instances, so every caller changes
remat's map. An option equal to remat's default (Trainer and PEFT pass those every call) keeps the config;
`offload=True`, `selective=True` and TRL's selective `context_fn` ask for that policy; other `context_fn`s: refused."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch.utils.checkpoint import create_selective_checkpoint_contexts

from .compat.transformers_compat import (
    ENABLE_ROUTES,
    TRL_SAC_MARKER,
    TRL_SAC_ROUTE,
    pretrained_model_class,
    routes_defined_on,
)
from .config import CheckpointConfig
from .errors import ConfigError, ConfigTypeError
from .refs import InstancePatches, Ref

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger("remat")

ROUTE_OPTIONS = ("every_n_layers", "offload", "use_reentrant", "preserve_rng_state", "selective")
_POLICY_SWITCHES = ("selective", "offload")  # True asks for that checkpoint_policy
_DEFAULTS = CheckpointConfig()


def _is_default(key: str, value: Any) -> bool:
    default = False if key in _POLICY_SWITCHES else getattr(_DEFAULTS, key)
    return type(value) is type(default) and value == default


def _selective_from_context(route: str, options: dict[str, Any], from_trl: bool) -> None:
    """TRL's selective checkpointing: a `context_fn` through the enable method TRL wrapped and marked."""
    if "context_fn" not in options:
        return
    context_fn = options.pop("context_fn")
    if not from_trl or getattr(context_fn, "func", None) is not create_selective_checkpoint_contexts:
        raise ConfigError(
            f"{route}: remat does not take a context_fn ({context_fn!r}): which activations each layer keeps is "
            "the checkpoint map's to say. For op-level selective checkpointing use checkpoint_policy='selective' "
            "(or the route option selective=True). Nothing was changed."
        )
    logger.info(
        "%s: TRL's selective checkpointing selects remat's 'selective' policy (remat keeps the outputs of the "
        "layers' projections and of fused attention; TRL's own policy keeps attention only)",
        route,
    )
    options["selective"] = True


def config_from_route(
    current: CheckpointConfig,
    route: str,
    kwargs_dict: Mapping[str, Any] | None,
    keywords: Mapping[str, Any],
    from_trl: bool = False,
) -> CheckpointConfig:
    """The config a route call asks for, starting from `current`. Raises before anything changes."""
    if kwargs_dict is not None and not isinstance(kwargs_dict, Mapping):
        raise ConfigTypeError(f"{route}: the checkpointing kwargs must be a dict, got {type(kwargs_dict).__name__}")
    options = dict(kwargs_dict or {})
    for key, value in keywords.items():
        if key in options and not _is_default(key, value) and options[key] != value:
            raise ConfigError(f"{route}: {key} is given twice ({options[key]!r} and {value!r}); give one")
        if key not in options or not _is_default(key, value):
            options[key] = value
    _selective_from_context(route, options, from_trl)
    if unknown := sorted(set(options) - set(ROUTE_OPTIONS)):
        raise ConfigError(
            f"{route}: remat does not know the checkpointing option(s) {unknown}; it accepts {list(ROUTE_OPTIONS)}. "
            "Nothing was changed. (Other torch.utils.checkpoint options are not supported, and remat never passes "
            "unknown keys into layer calls.)"
        )
    changes = {key: value for key, value in options.items() if not _is_default(key, value)}
    switched = [name for name in _POLICY_SWITCHES if name in changes]  # False, the default, is filtered out
    for name in switched:
        if not isinstance(changes.pop(name), bool):
            raise ConfigTypeError(f"{route}: {name} must be True or False, got {options[name]!r}")
    if len(switched) > 1:
        raise ConfigError(f"{route}: selective=True and offload=True are two policies; pass one. Nothing was changed.")
    if switched:
        changes["checkpoint_policy"] = switched[0]
        if switched == ["selective"] and options.get("use_reentrant") is False:  # asked with selective, which needs it
            changes["use_reentrant"] = False
    if not changes:
        return current  # the same config object: a planned config keeps its prediction
    try:
        return current.replace(**changes)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{route}: {err}") from None


def describe_changes(old: CheckpointConfig, new: CheckpointConfig) -> str:
    return ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in old.changed_fields(new).items())


def install_routes(patches: InstancePatches, owner: Any, model: nn.Module) -> None:
    """The routes on the model's `PreTrainedModel` instances: objects, so a copy drives the copy's wrapper."""
    for module in [m for m in model.modules() if isinstance(m, pretrained_model_class())]:
        for name in routes_defined_on(module):
            patches.set(module, name, (EnableRoute if name in ENABLE_ROUTES else DisableRoute)(owner, name, module))


class _Route:
    """A route method on one module for one owner. Code may keep it after the owner let go (TRL wraps the enable
    method): the call then goes to the module's current owner's route or transformers' own, never to a disabled one."""

    def __init__(self, owner: Any, route: str, module: Any):
        self.owner, self.route, self._module = owner, route, Ref(module)
        self.__name__ = route
        self.__doc__ = f"remat: `{route}` {type(self).__doc__}"

    def _current(self) -> Any:
        """None while this route's owner is enabled; else where the call goes instead."""
        module = self._module()
        if module is None or self.owner.is_enabled:
            return None
        if isinstance(now := module.__dict__.get(self.route), _Route) and now is not self and now.owner.is_enabled:
            return now
        return getattr(type(module), self.route).__get__(module)


class EnableRoute(_Route):
    """changes the checkpoint map of the CheckpointedModel that owns this model (its kwargs dict's options,
    `every_n_layers`, `offload`)."""

    def __init__(self, owner: Any, route: str, module: Any):
        super().__init__(owner, route, module)
        self.kwargs_name = route.replace("_enable", "_kwargs")

    @property
    def __signature__(self) -> inspect.Signature:
        # PEFT inspects the signature for this parameter name before passing the dict.
        P = inspect.Parameter
        options = [P(name, P.KEYWORD_ONLY, default=d) for name, d in (("every_n_layers", 1), ("offload", False))]
        return inspect.Signature([P(self.kwargs_name, P.POSITIONAL_OR_KEYWORD, default=None), *options])

    def __call__(self, *args: Any, every_n_layers: int = 1, offload: bool = False, **kwargs: Any) -> None:
        keywords = {"every_n_layers": every_n_layers, "offload": offload}
        current = self._current()
        if current is not None:  # (transformers before 5.16 takes neither keyword: pass them only if given)
            return current(*args, **{k: v for k, v in keywords.items() if not _is_default(k, v)}, **kwargs)
        try:
            kwargs_dict = self.__signature__.bind(*args, **kwargs).arguments.get(self.kwargs_name)
        except TypeError as err:
            raise ConfigTypeError(f"{self.route}(): {err}; pass {self.kwargs_name}, every_n_layers, offload") from None
        owner, route = self.owner, f"{self.route}()"
        try:
            config = config_from_route(owner.config, route, kwargs_dict, keywords, self._wrapped_by_trl())
            owner.replan(config, None, route)
        except (TypeError, ValueError) as err:
            if owner.off_by is None:
                raise
            # A generation toggle turned checkpointing off and its re-enable failed: say it is off.
            raise type(err)(
                f"{err} Checkpointing is still OFF (turned off by {owner.off_by}); turn it back on with {route} "
                "and options remat accepts, or with cm.enable()."
            ) from None

    def _wrapped_by_trl(self) -> bool:
        """Whether TRL's selective checkpointing wrapped this method (here, or on the owner's PeftModel)."""
        if self.route != TRL_SAC_ROUTE:
            return False
        holders = (self._module(), self.owner.model)
        return any(getattr(m.__dict__.get(self.route), TRL_SAC_MARKER, False) for m in holders if m is not None)


class DisableRoute(_Route):
    """turns every layer of the owner's checkpoint map to "none" until the next enable."""

    __signature__ = inspect.Signature([])

    def __call__(self) -> None:
        current = self._current()
        if current is not None:
            return current()
        self.owner.replan(self.owner.config, off_by=f"{self.route}()", cause=f"{self.route}()")
