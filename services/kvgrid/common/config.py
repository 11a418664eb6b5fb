"""Typed service configuration from defaults, a YAML file, ``KVGRID_*`` env vars and CLI flags.

A service config is a frozen ``msgspec.Struct`` whose fields are annotated
``Annotated[T, msgspec.Meta(description="...")]``; the description is the ``--help`` text. Layers, lowest
to highest precedence (see docs/configuration.md)::

    struct defaults  <  YAML file (--config)  <  KVGRID_<FIELD> env  <  --field-name flags

Env and flag values are strings; they are converted with ``msgspec.convert(strict=False)`` (ints,
floats, bools as true/false/1/0), lists are comma-separated, mappings are YAML flow text
(``{a: 1}``), and nested struct fields are reached with ``__`` in env names (``KVGRID_PEER__TIMEOUT_S``)
and ``.`` in flags (``--peer.timeout-s``). Fields typed :data:`ByteSize` accept ``"8GiB"``,
``"512MiB"``, ``"1GB"`` or plain byte counts. Every problem raises :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import os
import re
import types
from collections.abc import Iterator, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import msgspec
import yaml

__all__ = [
    "ByteSize",
    "ConfigError",
    "GiB",
    "KiB",
    "MiB",
    "TiB",
    "add_config_arguments",
    "check_choices",
    "config_from_args",
    "format_byte_size",
    "load_config",
    "parse_byte_size",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

T = TypeVar("T", bound=msgspec.Struct)


class ConfigError(ValueError):
    """A config value, key or file is invalid; the message names the field and what was expected."""


class _BadValue(Exception):
    """Raised inside coercion; reworded into a ConfigError that names the source of the value."""

    def __init__(self, path: str, value: object, expected: str) -> None:
        super().__init__(path, value, expected)
        self.path, self.value, self.expected = path, value, expected


class _ByteSizeMarker:
    """Annotation marker: the field is a byte count that also accepts "8GiB"-style strings."""

    def __repr__(self) -> str:
        return "ByteSize"


_BYTE_SIZE = _ByteSizeMarker()

# Bytes as a non-negative int; config loading also accepts "8GiB", "512MiB", "1GB", "4096".
ByteSize = Annotated[int, msgspec.Meta(ge=0), _BYTE_SIZE]

# Decimal (SI, k8s "K/M/G") and binary (IEC, k8s "Ki/Mi/Gi") units; matched case-insensitively.
_UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _UNITS[_p] = _UNITS[_p + "b"] = 1000**_i
    _UNITS[_p + "i"] = _UNITS[_p + "ib"] = 1024**_i
_BYTE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_BYTE_HELP = "a byte size such as 8GiB, 512MiB, 1GB or a whole number of bytes"


def parse_byte_size(value: object) -> int:
    """``"8GiB"`` -> 8589934592. Accepts non-negative ints and strings with an SI or IEC unit."""
    if isinstance(value, bool):
        raise ValueError(f"expected {_BYTE_HELP}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"expected {_BYTE_HELP}, got negative {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _BYTE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            exact = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
            if exact.denominator == 1:
                return int(exact)
            raise ValueError(f"expected {_BYTE_HELP}, got {value!r} (not a whole number of bytes)")
    raise ValueError(f"expected {_BYTE_HELP}, got {value!r}")


def format_byte_size(n: int) -> str:
    """The shortest exact IEC spelling: 8589934592 -> "8GiB", 1000 -> "1000"."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


# ---------------------------------------------------------------------------------------------
# Type helpers


def _unwrap(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    """Strip (nested) Annotated; returns the bare type and all metadata."""
    meta: tuple[Any, ...] = ()
    while get_origin(tp) is Annotated:
        meta += tp.__metadata__
        tp = tp.__origin__
    return tp, meta


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _non_none(tp: Any) -> list[Any]:
    return [a for a in get_args(tp) if a is not type(None)]


def _struct_type(tp: Any) -> type[msgspec.Struct] | None:
    """The Struct class of a field typed ``S`` or ``S | None``, else None."""
    tp, _ = _unwrap(tp)
    if _is_union(tp):
        args = _non_none(tp)
        if len(args) != 1:
            return None
        tp, _ = _unwrap(args[0])
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    return None


def _fields(cls: type[msgspec.Struct]) -> dict[str, msgspec.structs.FieldInfo]:
    return {f.encode_name: f for f in msgspec.structs.fields(cls)}


def _description(tp: Any) -> str:
    _, meta = _unwrap(tp)
    text = ""
    for m in meta:
        if isinstance(m, msgspec.Meta) and m.description:
            text = m.description
    return text


def _is_byte_size(tp: Any) -> bool:
    base, meta = _unwrap(tp)
    if any(m is _BYTE_SIZE for m in meta):
        return True
    return _is_union(base) and any(_is_byte_size(a) for a in _non_none(base))


def _default(f: msgspec.structs.FieldInfo) -> Any:
    if f.default is not msgspec.NODEFAULT:
        return f.default
    if f.default_factory is not msgspec.NODEFAULT:
        return f.default_factory()
    return msgspec.NODEFAULT


# ---------------------------------------------------------------------------------------------
# Coercion of raw layer values (strings from env/flags, YAML scalars) towards the field types


def _coerce(value: Any, tp: Any, path: str) -> Any:
    base, meta = _unwrap(tp)
    if any(m is _BYTE_SIZE for m in meta) and not isinstance(value, bool):
        try:
            return parse_byte_size(value)
        except ValueError:
            raise _BadValue(path, value, _BYTE_HELP) from None
    if _is_union(base):
        args = _non_none(base)
        if (
            isinstance(value, str)
            and value.strip().lower() in ("", "none", "null")
            and len(args) < len(get_args(base))
            and not any(_unwrap(a)[0] is str for a in args)
        ):
            return None
        return _coerce(value, args[0], path) if len(args) == 1 else value
    origin = get_origin(base) or base
    if isinstance(value, str) and origin is Literal:
        # Choices are spelled as declared; other letter cases of a choice mean the same choice.
        return next((c for c in get_args(base) if isinstance(c, str) and c.lower() == value.lower()), value)
    if isinstance(value, str):
        if origin in (list, tuple, set, frozenset):
            value = [part.strip() for part in value.split(",") if part.strip()]
        elif origin is dict or (isinstance(base, type) and issubclass(base, msgspec.Struct)):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise _BadValue(path, value, "a YAML flow mapping such as {key: value}") from None
    if isinstance(value, list) and origin in (list, tuple, set, frozenset):
        params = get_args(base)
        if origin is tuple and params and params[-1] is not Ellipsis:
            if len(params) == len(value):
                pairs = enumerate(zip(params, value, strict=True))
                return [_coerce(v, a, f"{path}[{i}]") for i, (a, v) in pairs]
            return value
        if params:
            return [_coerce(v, params[0], f"{path}[{i}]") for i, v in enumerate(value)]
        return value
    if isinstance(value, dict) and isinstance(base, type) and issubclass(base, msgspec.Struct):
        fields = _fields(base)
        return {
            k: (_coerce(v, fields[k].type, f"{path}.{k}") if k in fields else v) for k, v in value.items()
        }
    return value


# ---------------------------------------------------------------------------------------------
# Layers: each is a nested dict of encode names plus a map "a.b" -> where the value came from


def _valid(cls: type[msgspec.Struct]) -> str:
    return ", ".join(_fields(cls))


def _normalise_keys(data: Mapping[str, Any], cls: type[msgspec.Struct], where: str, prefix: str = "") -> dict:
    """Dashes -> underscores, dotted keys -> nesting; unknown keys raise naming the valid fields."""
    out: dict[str, Any] = {}
    fields = _fields(cls)
    for raw_key, value in data.items():
        if not isinstance(raw_key, str):
            raise ConfigError(f"config key {raw_key!r} in {where} is not a string")
        head, _, rest = raw_key.replace("-", "_").partition(".")
        if head not in fields:
            hint = difflib.get_close_matches(head, fields, n=1)
            did_you_mean = f" (did you mean {prefix + hint[0]!r}?)" if hint else ""
            raise ConfigError(
                f"unknown config key {prefix + head!r} in {where}{did_you_mean}; "
                f"valid fields of {cls.__name__}: {_valid(cls)}"
            )
        sub = _struct_type(fields[head].type)
        if rest:
            if sub is None:
                raise ConfigError(f"config key {raw_key!r} in {where}: {prefix + head!r} has no sub-fields")
            value = {rest: value}
        if sub is not None and isinstance(value, Mapping):
            value = _normalise_keys(value, sub, where, f"{prefix}{head}.")
            if isinstance(out.get(head), dict):
                value = _merge(out[head], value)
        out[head] = value
    return out


def _merge(base: dict, over: Mapping[str, Any]) -> dict:
    """Deep-merge nested struct mappings; any other value is replaced whole."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def _leaves(data: Mapping[str, Any], cls: type[msgspec.Struct], prefix: str = "") -> Iterator[str]:
    fields = _fields(cls)
    for k, v in data.items():
        sub = _struct_type(fields[k].type) if k in fields else None
        if sub is not None and isinstance(v, dict):
            yield from _leaves(v, sub, f"{prefix}{k}.")
        else:
            yield prefix + k


def _read_yaml(file: str | os.PathLike[str]) -> dict:
    try:
        text = Path(file).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(file)!r}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(file)!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(file)!r} must hold a mapping of field names to values, "
            f"got {type(data).__name__}"
        )
    return data


# difflib ratio above which an unknown KVGRID_ name counts as a typo of one of our fields ("PROT" ~ "PORT").
_TYPO_CUTOFF = 0.75


def _env_layer(cls: type[msgspec.Struct], env: Mapping[str, str], env_prefix: str) -> tuple[dict, dict]:
    """``KVGRID_FIELD`` / ``KVGRID_OUTER__INNER`` -> nested dict.

    Other services share the prefix, so an unknown name is an error only when it looks like a typo of
    one of our fields (close match) or when it reaches into one of our nested structs.
    """
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, raw in sorted(env.items()):
        if not name.startswith(env_prefix) or len(name) == len(env_prefix):
            continue
        parts = name[len(env_prefix) :].lower().split("__")
        target: type[msgspec.Struct] | None = cls
        path: list[str] = []
        for depth, part in enumerate(parts):
            fields = {k.lower(): k for k in _fields(target)} if target is not None else {}
            if part not in fields:
                hint = difflib.get_close_matches(part, fields, n=1, cutoff=_TYPO_CUTOFF)
                if depth == 0 and not hint:
                    break  # belongs to another service's config
                owner = target.__name__ if target is not None else ".".join(path)
                valid = ", ".join(env_prefix + "__".join([*path, k]).upper() for k in fields)
                near = env_prefix + "__".join([*path, hint[0]]).upper() if hint else ""
                did_you_mean = f" (did you mean {near}?)" if hint else ""
                raise ConfigError(
                    f"unknown environment variable {name}: {owner} has no field {part!r}{did_you_mean}; "
                    f"valid variables: {valid or '(none: ' + '.'.join(path) + ' has no sub-fields)'}"
                )
            key = fields[part]
            path.append(key)
            target = _struct_type(_fields(target)[key].type) if target is not None else None
        else:
            node = data
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = raw
            sources[".".join(path)] = f"env {name}"
    return data, sources


# ---------------------------------------------------------------------------------------------
# Assembly and error rewording

_PATH_RE = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _lookup(data: Any, path: str) -> Any:
    for key, index in _PATH_RE.findall(path):
        try:
            data = data[key] if key else data[int(index)]
        except (KeyError, IndexError, TypeError):
            return msgspec.NODEFAULT
    return data


def _type_at(cls: type[msgspec.Struct], path: str) -> Any:
    """The annotation a msgspec error path like ``.peer.hosts[1]`` points at (Any when unknown)."""
    tp: Any = cls
    for key, _index in _PATH_RE.findall(path):
        base, _ = _unwrap(tp)
        if _is_union(base) and len(_non_none(base)) == 1:
            base, _ = _unwrap(_non_none(base)[0])
        if key and isinstance(base, type) and issubclass(base, msgspec.Struct):
            field = _fields(base).get(key)
            tp = field.type if field is not None else Any
        elif not key and get_args(base):
            tp = get_args(base)[0]
        else:
            return Any
    return tp


def _choices(tp: Any) -> list[Any]:
    base, _ = _unwrap(tp)
    if _is_union(base) and len(_non_none(base)) == 1:
        base, _ = _unwrap(_non_none(base)[0])
    if get_origin(base) is Literal:
        return list(get_args(base))
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return [m.value for m in base]
    return []


def _one_of(choices: list[Any]) -> str:
    """``auto, on or off``."""
    names = [str(c) for c in choices]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def check_choices(config: msgspec.Struct) -> None:
    """ValueError naming the field, its value and the allowed choices when a ``Literal`` or enum
    field holds another value. The loader refuses those itself; call this from ``__post_init__`` so a
    config built directly in code is held to the same choices."""
    for f in msgspec.structs.fields(config):
        choices = _choices(f.type)
        value = getattr(config, f.name)
        if choices and value not in choices:
            raise ValueError(f"{f.name}={value!r}: expected {_one_of(choices)}")


def _source(sources: Mapping[str, str], dotted: str) -> str:
    probe = re.sub(r"\[\d+\]", "", dotted)
    while probe:
        if probe in sources:
            return sources[probe]
        probe = probe.rpartition(".")[0]
    return "default"


def _reword(
    err: msgspec.ValidationError, cls: type[msgspec.Struct], data: dict, sources: dict, env_prefix: str
) -> ConfigError:
    text = str(err)
    msg, sep, where = text.rpartition(" - at `")
    if not sep:
        msg, where = text, "$`"
    path = where.rstrip("`")
    dotted = path[2:] if path.startswith("$.") else ""
    missing = re.fullmatch(r"Object missing required field `(.+)`", msg)
    if missing:
        name = f"{dotted}.{missing.group(1)}" if dotted else missing.group(1)
        env_name = env_prefix + name.replace(".", "__").upper()
        flag = "--" + name.replace("_", "-")
        return ConfigError(
            f"config field {name!r} is required: set it in the YAML file, with {env_name} or with {flag}"
        )
    if not dotted:
        return ConfigError(f"invalid {cls.__name__} config: {msg}")
    value = _lookup(data, path[1:])
    shown = "" if value is msgspec.NODEFAULT else f" {value!r}"
    expected = msg[0].lower() + msg[1:] if msg.startswith("Expected") else msg
    if msg.startswith("Invalid enum value"):
        expected = "expected one of " + ", ".join(repr(c) for c in _choices(_type_at(cls, path[1:])))
    return ConfigError(
        f"config field {dotted!r} has invalid value{shown} (from {_source(sources, dotted)}): {expected}"
    )


def _build(cls: type[T], layers: list[tuple[dict, dict]], env_prefix: str) -> T:
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for layer, layer_sources in layers:
        data = _merge(data, layer)
        sources.update(layer_sources)
    fields = _fields(cls)
    try:
        data = {k: _coerce(v, fields[k].type, k) for k, v in data.items()}
    except _BadValue as e:
        raise ConfigError(
            f"config field {e.path!r} has invalid value {e.value!r} "
            f"(from {_source(sources, e.path)}): expected {e.expected}"
        ) from None
    try:
        return msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as e:
        raise _reword(e, cls, data, sources, env_prefix) from None


def _file_layer(cls: type[msgspec.Struct], file: str | os.PathLike[str] | None) -> tuple[dict, dict]:
    if file is None:
        return {}, {}
    where = f"config file {str(file)!r}"
    data = _normalise_keys(_read_yaml(file), cls, where)
    return data, {leaf: where for leaf in _leaves(data, cls)}


def load_config(
    config_type: type[T],
    *,
    file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    env_prefix: str = "KVGRID_",
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Build ``config_type``: defaults < ``file`` (YAML) < ``env`` (default os.environ) < ``overrides``.

    ``overrides`` play the role of CLI flags: keys are field names (``peer.timeout_s`` or nested
    mappings reach nested structs); string values are converted like env values.
    """
    layers = [
        _file_layer(config_type, file),
        _env_layer(config_type, os.environ if env is None else env, env_prefix),
    ]
    if overrides:
        data = _normalise_keys(overrides, config_type, "overrides")
        layers.append((data, {leaf: "override" for leaf in _leaves(data, config_type)}))
    return _build(config_type, layers, env_prefix)


# ---------------------------------------------------------------------------------------------
# argparse integration

_FILE_DEST = "config_file"
_DEST_PREFIX = "config_field:"


def _show_default(f: msgspec.structs.FieldInfo) -> str:
    value = _default(f)
    if value is msgspec.NODEFAULT:
        return "required"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and _is_byte_size(f.type):
        return format_byte_size(value)
    if value is None:
        return "none"
    if value == "":
        return '""'
    if isinstance(value, list | tuple | set | frozenset):
        return ",".join(str(v) for v in value) or "empty"
    if isinstance(value, msgspec.Struct | dict):
        return msgspec.json.encode(value).decode()
    return str(value)


def _metavar(tp: Any) -> str:
    if _is_byte_size(tp):
        return "SIZE"
    base, _ = _unwrap(tp)
    if _is_union(base) and len(_non_none(base)) == 1:
        base, _ = _unwrap(_non_none(base)[0])
    origin = get_origin(base) or base
    if origin is Literal:
        return "{" + ",".join(str(a) for a in get_args(base)) + "}"
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return "{" + ",".join(str(m.value) for m in base) + "}"
    if origin in (list, tuple, set, frozenset):
        return "A,B,..."
    if origin is dict:
        return "{K: V}"
    names = {bool: "BOOL", int: "INT", float: "FLOAT", str: "TEXT"}
    return names.get(base, "VALUE")


def _add_fields(
    group: argparse._ArgumentGroup, cls: type[msgspec.Struct], env_prefix: str, prefix: str = ""
) -> None:
    for name, f in _fields(cls).items():
        sub = _struct_type(f.type)
        if sub is not None:
            _add_fields(group, sub, env_prefix, f"{prefix}{name}.")
            continue
        dotted = prefix + name
        desc = _description(f.type) or f"{cls.__name__}.{name}"
        env_name = env_prefix + dotted.replace(".", "__").upper()
        help_text = f"{desc} (default: {_show_default(f)}; env {env_name})".replace("%", "%%")
        action = group.add_argument(
            "--" + dotted.replace("_", "-"),
            dest=_DEST_PREFIX + dotted,
            metavar=_metavar(f.type),
            default=argparse.SUPPRESS,  # absent unless given, so lower layers show through
            help=help_text,
        )
        if _unwrap(f.type)[0] is bool:  # bare --flag means true; --flag false also works
            action.nargs, action.const = "?", "true"


def add_config_arguments(
    parser: argparse.ArgumentParser, config_type: type[msgspec.Struct], *, env_prefix: str = "KVGRID_"
) -> None:
    """Add ``--config FILE`` and one ``--field-name`` flag per field (``--outer.inner`` for nested)."""
    group = parser.add_argument_group(
        f"configuration ({config_type.__name__})",
        f"precedence: defaults < --config YAML file < {env_prefix}* env < these flags",
    )
    group.add_argument(
        "--config", dest=_FILE_DEST, metavar="FILE", default=None, help="YAML file with config fields"
    )
    _add_fields(group, config_type, env_prefix)


def config_from_args(
    config_type: type[T],
    args: argparse.Namespace,
    env: Mapping[str, str] | None = None,
    env_prefix: str = "KVGRID_",
) -> T:
    """The config for parsed ``args`` (from a parser set up by :func:`add_config_arguments`)."""
    given = vars(args)
    flags: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for dest, value in given.items():
        if dest.startswith(_DEST_PREFIX):
            dotted = dest[len(_DEST_PREFIX) :]
            flags = _merge(flags, _normalise_keys({dotted: value}, config_type, "flags"))
            sources[dotted] = "flag --" + dotted.replace("_", "-")
    layers = [
        _file_layer(config_type, given.get(_FILE_DEST)),
        _env_layer(config_type, os.environ if env is None else env, env_prefix),
        (flags, sources),
    ]
    return _build(config_type, layers, env_prefix)
