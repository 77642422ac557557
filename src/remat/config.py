"""`CheckpointConfig`: what a person asks remat to do, validated the moment it is made.

A frozen value: the wrapper's map is planned from it, and a config changed in place would drift
from that map; build a new one (``config.replace(every_n_layers=2)``) for ``cm.enable(config)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .arguments import MAX_COUNT, check_flag, parse_bytes
from .errors import ConfigError, ConfigTypeError, FrozenConfigError, SavedFileError
from .policies import CHECKPOINT_POLICIES
from .policies import NAMES as POLICIES
from .policies import policy as _policy
from .saving.files import no_config, read_json_object
from .saving.folder import CONFIG_NAME, read_pair, save_pair
from .version import __version__

HEADS = ("plain", "chunked")  # the head row's policies (`remat.head`)
BUDGET_SCOPES = ("step", "activations")  # what a budget bounds (`remat.budget`)

logger = logging.getLogger("remat")
SWAP_PLACEMENTS = ("spread", "tail")
# `checkpoint_config.json`'s schema: 2 added "selective" (read as recompute by 1), 3 `architecture`
# and the adapters' `config_sha256` (unchecked by 2). Newer files are refused; older ones load.
FORMAT_VERSION = 3
META_KEYS = (
    "format_version",
    "remat_version",
    "layers",
    "adapters",
    "architecture",
    "budget_profile",
    "active_adapters",
)  # about the save, not the config
OFFLOAD_IS_A_POLICY = (
    'offload is a policy: checkpoint_policy="offload" for every checkpointed layer, or layer_policies={i: "offload"}'
)


class FrozenPolicies(Mapping[int, str]):
    """The read-only `{layer index: policy}` a config holds: not a dict, whose own methods
    (`dict.__setitem__(m, ...)`, `m |= {...}`) would change the config's hash and plan in place."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[int, str]):
        object.__setattr__(self, "_items", dict(sorted(items.items())))

    def __getitem__(self, key: int) -> str:
        return self._items[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def _refuse(self, *args: Any) -> None:
        raise ConfigTypeError(
            "CheckpointConfig is immutable: build a new one with config.replace(layer_policies=...) "
            "and pass it to cm.enable(config)"
        )

    __setattr__ = __delattr__ = __setitem__ = __delitem__ = __ior__ = _refuse  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._items)

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (dict(self._items),))


def _check_in(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        off = name == "checkpoint_policy" and value == "none"
        none = " (no checkpointing: cm.disable(), or layer_policies={i: 'none'} per layer)" if off else ""
        raise ConfigError(f"CheckpointConfig.{name} must be one of {allowed}, got {value!r}{none}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"CheckpointConfig.{name} must be a finite int, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"CheckpointConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value > MAX_COUNT:
        raise ConfigError(f"CheckpointConfig.{name} must be at most {MAX_COUNT}, got {len(str(value))} digits")
    if value < minimum:
        raise ConfigError(f"CheckpointConfig.{name} must be >= {minimum}, got {value}")


def _layer_index(name: str, key: Any) -> int:
    """Accept an int index, or its decimal string (JSON object keys are always strings)."""
    if isinstance(key, str) and re.fullmatch(r"\s*[+-]?\d+\s*", key):
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, int):
        raise ConfigTypeError(
            f"CheckpointConfig.{name}: layer indices must be ints (or their decimal strings), got {key!r} "
            f"({type(key).__name__}); use the layer's position in the map, 0 for the first"
        )
    if key < 0:
        raise ConfigError(
            f"CheckpointConfig.{name}: layer index {key} is out of range (negative); indices count from 0, the first "
            "layer, and do not count from the end: use 0..(number of layers - 1)"
        )
    return key


def _without_offload_flag(data: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    """A config saved when offload was a flag: `"offload": true` made "recompute" layers "offload"
    ones (said so now), and kept "selective" inputs on the host, which no policy does (refused)."""
    data = dict(data)
    flag = data.pop("offload", False)
    if flag is False:
        return data
    if flag is not True:
        raise ConfigError(f'{source}: "offload" must be true or false, got {flag!r}')
    policies = data.get("layer_policies")
    chosen = {data.get("checkpoint_policy", "recompute"), *(policies.values() if isinstance(policies, Mapping) else ())}
    if "selective" in chosen:
        raise ConfigError(
            f'{source}: "offload": true kept the inputs of "selective" layers in host memory, which remat no longer '
            'does. Remove "offload" (those inputs then stay on the device) or give those layers "offload"'
        )
    if data.get("checkpoint_policy", "recompute") == "recompute":
        data["checkpoint_policy"] = "offload"
    return data


@dataclass(frozen=True, eq=False, repr=False)
class CheckpointConfig:
    """How activation memory is paid for, layer by layer.

    Args:
        every_n_layers: checkpoint layers 0, N, 2N, ... in module order (transformers' rule); 1: every layer.
        offload_min_bytes: inputs of "offload" layers under this stay on the device (the copy costs more); bytes, or
            a size like the budget's ("2MiB").
        swap_layers: how many layers (int) or which ones (indices) keep their frozen weights in host memory.
        swap_placement: where a count of swapped layers goes: "spread" over the stack, or "tail" (a list of
            indices says where itself: "tail" with one is refused).
        layer_policies: {layer index: "none" | "recompute" | "offload" | "selective"}: single-layer overrides.
        checkpoint_policy: how every other checkpointed layer runs: "recompute" (the whole layer again in
            backward), "offload" (the same, its input waiting in host memory: the one way to ask for
            offload) or "selective" (matmul and attention outputs kept, the rest recomputed).
        use_reentrant: torch's reentrant checkpoint, not the non-reentrant default (not with "selective").
        preserve_rng_state: replay the forward's RNG state during recompute, so dropout masks match.
        head: "plain" (the model's own head and loss) or "chunked": a training forward with labels computes
            the causal-LM loss in chunks of counted tokens, never the full logits (`remat.head`).
        head_chunk_tokens: tokens per chunk for "chunked" (None: 1024; with a budget, the planner's choice).
        budget: bytes (or a size like "20GiB") the map is planned for by itself: on the first training step,
            then again whenever a step's token count falls in another bucket (`remat.budget`). None: the
            map is the config's.
        budget_scope: what the budget bounds: "step" (the peak of a whole training step, with the optimizer's
            state where the wrapper knows the optimizer) or "activations" (the bytes held for backward).
    """

    every_n_layers: int = 1
    offload_min_bytes: int = 2 * 1024**2  # a size ("2MiB") is taken too, and parsed (held in bytes: what is read)
    swap_layers: int | Sequence[int] = 0  # indices: a sorted tuple once made
    swap_placement: str = "spread"
    layer_policies: Mapping[int, str] = field(default_factory=dict)
    checkpoint_policy: str = "recompute"
    use_reentrant: bool = False
    preserve_rng_state: bool = True
    head: str = "plain"
    head_chunk_tokens: int | None = None
    budget: int | str | None = None
    budget_scope: str = "step"

    def __new__(cls, *args: Any, **fields: Any) -> CheckpointConfig:
        if "offload" in fields:
            raise ConfigTypeError(f"CheckpointConfig(offload=...) is gone: {OFFLOAD_IS_A_POLICY}")
        refuse_unknown_fields(fields, "CheckpointConfig() got an unexpected keyword argument {first!r}{hint}", "=")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _check_int("every_n_layers", self.every_n_layers, 1)
        object.__setattr__(
            self, "offload_min_bytes", parse_bytes(self.offload_min_bytes, "CheckpointConfig.offload_min_bytes")
        )
        for name in ("use_reentrant", "preserve_rng_state"):
            check_flag(getattr(self, name), f"CheckpointConfig.{name}")
        _check_in("swap_placement", self.swap_placement, SWAP_PLACEMENTS)
        object.__setattr__(self, "swap_layers", _validated_swap_layers(self.swap_layers))
        if isinstance(self.swap_layers, tuple) and self.swap_placement != "spread":
            raise ConfigError(
                f"CheckpointConfig.swap_placement={self.swap_placement!r} places a count of swapped layers; "
                f"swap_layers={list(self.swap_layers)} names them: give a count (swap_layers={len(self.swap_layers)}) "
                "or swap_placement='spread' (the default)"
            )
        object.__setattr__(self, "layer_policies", _validated_layer_policies(self.layer_policies))
        _check_in("checkpoint_policy", self.checkpoint_policy, CHECKPOINT_POLICIES)
        _check_in("head", self.head, HEADS)
        if self.head_chunk_tokens is not None:
            _check_int("head_chunk_tokens", self.head_chunk_tokens, 1)
            if self.head == "plain":
                raise ConfigError(
                    f'CheckpointConfig(head_chunk_tokens={self.head_chunk_tokens}) sizes the chunks of head="chunked", '
                    'but head is "plain": add head="chunked", or leave head_chunk_tokens out'
                )
        _check_in("budget_scope", self.budget_scope, BUDGET_SCOPES)
        if self.budget is not None:
            parse_bytes(self.budget, "CheckpointConfig.budget", least=1)
            if self.layer_policies:
                raise ConfigError(
                    "CheckpointConfig(budget=...) chooses every layer's policy, so layer_policies would be overruled: "
                    "give a budget or layer_policies, not both: cm.enable(budget=None, layer_policies=...) sets a map "
                    "by hand, cm.enable(budget=..., layer_policies={}) plans by budget"
                )
        chosen = {self.checkpoint_policy, *self.layer_policies.values()}
        picky = sorted(name for name in chosen if _policy(name).needs_non_reentrant)
        if self.use_reentrant and picky:
            raise ConfigError(
                f"CheckpointConfig.use_reentrant=True cannot run the {picky} policy: torch supports it only in "
                "non-reentrant checkpointing; use use_reentrant=False (the default)"
            )

    @property
    def budget_bytes(self) -> int | None:
        """`budget` in bytes (None: no budget)."""
        return None if self.budget is None else parse_bytes(self.budget, "CheckpointConfig.budget")

    def _values(self) -> tuple[Any, ...]:
        """What equality compares: the fields, the budget in bytes ("1MiB" and 1048576 plan alike; unequal, a
        re-enable with the other spelling planned again); layer_policies a hashable FrozenPolicies."""
        return tuple(self.budget_bytes if name == "budget" else getattr(self, name) for name in _FIELDS)

    def __eq__(self, other: object) -> bool:
        # isinstance, not class identity: a PlannedConfig equals the plain config with its fields.
        return self._values() == other._values() if isinstance(other, CheckpointConfig) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return f"CheckpointConfig({', '.join(f'{name}={getattr(self, name)!r}' for name in _FIELDS)})"

    def replace(self, **changes: Any) -> CheckpointConfig:
        """A new config with `changes` applied, validated like any other. `head="plain"` alone drops the
        chunk size too (it sizes only the chunked head's chunks)."""
        if "offload" in changes:
            raise ConfigTypeError(f"CheckpointConfig has no field offload: {OFFLOAD_IS_A_POLICY}")
        refuse_unknown_fields(changes, "CheckpointConfig has no field(s) {unknown}{hint}", "")
        if changes.get("head") == "plain" and "head_chunk_tokens" not in changes:
            changes["head_chunk_tokens"] = None
        return CheckpointConfig(**{**{name: getattr(self, name) for name in _FIELDS}, **changes})

    def changed_fields(self, other: CheckpointConfig) -> dict[str, tuple[Any, Any]]:
        """{field: (value here, value in other)} for every field that differs."""
        same = zip(_FIELDS, self._values(), other._values(), strict=True)
        return {name: (getattr(self, name), getattr(other, name)) for name, a, b in same if a != b}

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values: lists for tuples, string keys for layer indices."""
        out = {name: getattr(self, name) for name in _FIELDS}
        swapped = self.swap_layers
        out["swap_layers"] = list(swapped) if isinstance(swapped, tuple) else swapped
        out["layer_policies"] = {str(k): v for k, v in self.layer_policies.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> CheckpointConfig:
        """Build a config from `to_dict()` output. Keys this version does not know are ignored
        with one warning (a newer remat may have written them); bad values raise."""
        if not isinstance(data, Mapping):
            raise SavedFileError(f"{source}: expected a JSON object, got {type(data).__name__}; save the config again")
        version = data.get("format_version", FORMAT_VERSION)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise SavedFileError(f"{source}: format_version must be a positive int, got {version!r}; save it again")
        if version > FORMAT_VERSION:
            raise SavedFileError(
                f"{source} has format_version {version}, but this remat ({__version__}) reads format_version "
                f"{FORMAT_VERSION} and older: it was written by a newer remat; upgrade remat to load it"
            )
        data = _without_offload_flag(data, source)
        if isinstance(data.get("swap_layers"), list) and data.get("swap_placement", "spread") != "spread":
            logger.warning(  # saved before such a pair was refused, when it changed nothing: it still changes nothing
                "%s: swap_placement=%r places a count of swapped layers, not the list saved: read as 'spread'",
                source,
                data["swap_placement"],
            )
            data = {**data, "swap_placement": "spread"}
        if unknown := sorted(set(data) - set(_FIELDS) - set(META_KEYS)):
            logger.warning("%s: ignoring keys this remat does not know: %s", source, unknown)
        if "format_version" in data and version >= 3 and (missing := [n for n in _FORMAT_3_FIELDS if n not in data]):
            logger.warning(  # (fields added since, e.g. budget and head, are missing from older saves: defaults)
                "%s: %s missing, which every save of format_version 3 writes (edited by hand, or damaged?): "
                "the defaults apply",
                source,
                missing,
            )
        try:
            return cls(**{k: v for k, v in data.items() if k in _FIELDS})
        except (TypeError, ValueError) as err:
            raise SavedFileError(f"{source}: {err} (correct that field, or save the config again)") from None

    def to_json_string(self) -> str:
        payload = {"format_version": FORMAT_VERSION, "remat_version": __version__, **self.to_dict()}
        return json.dumps(payload, indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        """Write `checkpoint_config.json` into `save_directory`, staged and committed like every
        remat save (`remat.saving.folder.save_pair`), and return its path."""
        save_pair(save_directory, lambda staging: self.to_json_string())
        return os.path.join(save_directory, CONFIG_NAME)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> CheckpointConfig:
        """Read `checkpoint_config.json` from a folder (or the file itself); in a folder like every
        remat load (`remat.saving.folder.read_pair`): locked, after a crashed save is finished or cleaned."""
        if os.path.isdir(path):
            with read_pair(path) as snapshot:
                file = snapshot.path(CONFIG_NAME)
                if snapshot.config is None:
                    raise no_config(file)
                return cls.from_dict(snapshot.config, source=file)
        file = os.fspath(path)
        return cls.from_dict(read_json_object(file), source=file)


_FIELDS = tuple(f.name for f in dataclasses.fields(CheckpointConfig))
# `help()` and `inspect.signature` read the fields, not `__new__`'s (*args, **fields)
_INIT = inspect.signature(CheckpointConfig.__init__)
CheckpointConfig.__signature__ = _INIT.replace(parameters=list(_INIT.parameters.values())[1:])  # type: ignore[attr-defined]
_FORMAT_3_FIELDS = (  # in every save since format_version 3 (head and budget came later: older saves lack them)
    "every_n_layers",
    "offload_min_bytes",
    "swap_layers",
    "swap_placement",
    "layer_policies",
    "checkpoint_policy",
    "use_reentrant",
    "preserve_rng_state",
)


def _refuse_assignment(config: CheckpointConfig, name: str, *_: Any) -> None:
    how = f"{name}=..." if name in _FIELDS else "field=..."
    raise FrozenConfigError(
        f"CheckpointConfig is immutable (cannot change {name}): cm.enable({how}) changes the wrapper's config; "
        f"config.replace({how}) makes a new one (fields: {', '.join(_FIELDS)})"
    )


# (a frozen dataclass may not define these in its body)
CheckpointConfig.__setattr__ = CheckpointConfig.__delattr__ = _refuse_assignment  # type: ignore[method-assign,assignment]


def refuse_unknown_fields(fields: Mapping[str, Any], message: str, equals: str, options: tuple[str, ...] = ()) -> None:
    """A ConfigTypeError (a TypeError) naming the unknown fields, the known one nearest the first (a field, or one
    of a caller's own `options`), and every one."""
    if unknown := sorted(set(fields) - {*_FIELDS, *options}):
        close = difflib.get_close_matches(unknown[0], (*_FIELDS, *options), n=1)
        hint = f" (did you mean {close[0]}{equals}?)" if close else ""
        said = message.format(first=unknown[0], unknown=unknown, hint=hint)
        raise ConfigTypeError(f"{said}; it takes the fields of CheckpointConfig ({', '.join(_FIELDS + options)})")


def _validated_swap_layers(value: Any) -> int | tuple[int, ...]:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, memoryview)):  # list, range
        indices = tuple(_layer_index("swap_layers", v) for v in value)
        if len(set(indices)) != len(indices):
            raise ConfigError(f"CheckpointConfig.swap_layers lists a layer twice: {list(value)}; list each once")
        return tuple(sorted(indices))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(
            f"CheckpointConfig.swap_layers must be an int (how many layers) or a list of layer indices, got {value!r} "
            f"({type(value).__name__})"
        )
    _check_int("swap_layers", value, 0)
    return value


def _validated_layer_policies(value: Any) -> Mapping[int, str]:
    if not isinstance(value, Mapping):
        raise ConfigTypeError(
            f"CheckpointConfig.layer_policies must be a dict {{layer index: policy}}, got {type(value).__name__}"
        )
    checked: dict[int, str] = {}
    for key, policy in value.items():
        index = _layer_index("layer_policies", key)
        _check_in(f"layer_policies[{index}]", policy, POLICIES)
        if index in checked:
            raise ConfigError(f"CheckpointConfig.layer_policies names layer {index} twice; name it once")
        checked[index] = policy
    return FrozenPolicies(checked)
