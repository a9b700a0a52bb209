"""Typed config building: an OmegaConf tree in, frozen dataclasses out, every value checked against its type hint.

The dataclasses in `shardrl.job.schema` are the schema. `build(cls, tree, prefix)` reads each key exactly once
(here), so type errors, bad `Literal` choices and out-of-range sizes all surface as one `ConfigError` line naming the
dotted key: ``actor_rollout_ref.actor.loss_agg_mode: 'foo' is not one of token-mean | seq-mean-token-sum | ...``.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from shardrl.job.errors import ConfigError
from shardrl.job.keys import closest_key

MISSING_VALUE = "???"  # OmegaConf's marker for a mandatory value (e.g. a user config leaving a key to the CLI)


@dataclasses.dataclass(frozen=True)
class Min:
    """Bound for `Annotated` numbers: value >= low (or > low when `strict`)."""

    low: float
    strict: bool = False

    def check(self, value: float) -> str | None:
        bad = value <= self.low if self.strict else value < self.low
        return f"must be {'>' if self.strict else '>='} {self.low:g}, got {value!r}" if bad else None


@dataclasses.dataclass(frozen=True)
class Max:
    high: float

    def check(self, value: float) -> str | None:
        return f"must be <= {self.high:g}, got {value!r}" if value > self.high else None


PosInt = Annotated[int, Min(1)]
NonNegInt = Annotated[int, Min(0)]
PosFloat = Annotated[float, Min(0, strict=True)]
NonNegFloat = Annotated[float, Min(0)]
Fraction = Annotated[float, Min(0, strict=True), Max(1)]  # (0, 1]


def _join(prefix: str, name: str | int) -> str:
    if isinstance(name, int):
        return f"{prefix}[{name}]"
    return f"{prefix}.{name}" if prefix else name


def build(cls: type, tree: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from the plain (resolved) mapping `tree`; keys absent from `tree` are an error unless
    the field has a default (used only for keys that exist in some configs and not others)."""
    if not isinstance(tree, dict):
        raise ConfigError(prefix or "<root>", f"expected a group of keys, got {tree!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    for key in tree:
        if key not in names:
            raise unknown_key(_join(prefix, key), field_paths(cls, prefix))
    hints = get_type_hints(cls, include_extras=True)
    values = {}
    for f in dataclasses.fields(cls):
        key = _join(prefix, f.name)
        if f.name not in tree:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(key, "missing from the config")
            continue
        values[f.name] = convert(hints[f.name], tree[f.name], key)
    return cls(**values)


def convert(hint: Any, value: Any, key: str) -> Any:
    """Check `value` against type `hint` and return it (lists and nested dataclasses converted recursively)."""
    if value == MISSING_VALUE:
        raise ConfigError(key, "is required: set it on the command line or in your config")
    origin = get_origin(hint)
    if origin is Annotated:
        base, *marks = get_args(hint)
        value = convert(base, value, key)
        for mark in marks:
            reason = mark.check(value) if value is not None else None
            if reason:
                raise ConfigError(key, reason)
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(get_args(hint), value, key)
    if origin is Literal:
        choices = get_args(hint)
        if value not in choices:
            raise ConfigError(key, f"{value!r} is not one of {' | '.join(map(str, choices))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, e.g. [{value}], got {value!r}")
        (item,) = get_args(hint)
        return [convert(item, v, _join(key, i)) for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping of keys, got {value!r}")
        entry = get_args(hint)[1] if get_args(hint) else Any
        if dataclasses.is_dataclass(entry):  # named groups of one schema (entries added with Hydra's `+`)
            return {name: build(entry, group, _join(key, name)) for name, group in value.items()}
        return value
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key)
    return _convert_scalar(hint, value, key)


def _convert_union(members: tuple, value: Any, key: str) -> Any:
    if value is None:
        if type(None) in members:
            return None
        raise ConfigError(key, "must be set (null is not allowed here)")
    errors = []
    for member in members:
        if member is type(None):
            continue
        try:
            return convert(member, value, key)
        except ConfigError as err:
            errors.append(err.reason)
    raise ConfigError(key, errors[0] if len(errors) == 1 else " or ".join(errors))


def _convert_scalar(hint: Any, value: Any, key: str) -> Any:
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if isinstance(value, (dict, list)) or value is None or isinstance(value, bool):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return str(value)  # numbers given on the command line (experiment_name=123) are fine as names
    raise TypeError(f"schema type {hint!r} of {key} is not supported")  # a bug in the schema, not user input


def unknown_key(key: str, paths: list[str]) -> ConfigError:
    """The error for `key`, which is none of `paths` (the known dotted leaves around it): the closest of them."""
    guess = closest_key(key, paths)
    return ConfigError(key, f"unknown key; did you mean {guess}?" if guess else
                       "unknown key (docs/config.md lists every key; --help the most used)")


def field_paths(cls: type, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf field of `cls` (nested dataclasses expanded; free-form dicts are leaves)."""
    return [path for path, _ in _leaf_hints(cls, prefix)]


def mapping_paths(cls: type, prefix: str = "") -> list[str]:
    """The leaves of `cls` that are free-form mappings (`dict` fields: any entry, added with Hydra's `+`)."""
    return [path for path, hint in _leaf_hints(cls, prefix)
            if dict in (hint, get_origin(hint)) or dict in map(get_origin, get_args(hint))]


def _leaf_hints(cls: type, prefix: str) -> list[tuple[str, Any]]:
    leaves = []
    hints = get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        inner = _dataclass_in(hints[f.name])
        key = _join(prefix, f.name)
        leaves.extend(_leaf_hints(inner, key) if inner else [(key, hints[f.name])])
    return leaves


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field holds (also through `X | None`), or None for leaves."""
    if dataclasses.is_dataclass(hint):
        return hint
    if get_origin(hint) in (Union, types.UnionType):
        found = [a for a in get_args(hint) if dataclasses.is_dataclass(a)]
        return found[0] if found else None
    return None

