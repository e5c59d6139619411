"""Generic configuration machinery: YAML -> typed dataclasses, ``--set a.b=c`` overrides, nearest-key hints.

The typed sections live next to the code that uses them (``ModelConfig`` in :mod:`lmforge.model`,
``RunConfig`` and friends in :mod:`lmforge.train`); this module only knows how to fill any dataclass from a
nested dict, checking every key and every value's type on the way::

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Opt:
    ...     lr: float = 1e-3
    ...     warmup_steps: int = 0
    >>> from_dict(Opt, {"lr": "3e-4"})          # YAML 1.1 reads 3e-4 as a string; floats accept it
    Opt(lr=0.0003, warmup_steps=0)
    >>> from_dict(Opt, {"warmup_step": 10})
    Traceback (most recent call last):
    ...
    ValueError: unknown config key 'warmup_step' (did you mean 'warmup_steps'?); valid keys: lr, warmup_steps

Validation of *values* (ranges, divisibility, ...) belongs to each dataclass's ``__post_init__``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Union

import yaml

from lmforge.common import atomic_write_text, check_input_file

__all__ = ["from_dict", "to_dict", "apply_overrides", "load_yaml", "dump_yaml", "diff_dicts", "nearest_key"]


def nearest_key(key: str, valid: Iterable[str]) -> str | None:
    """The valid key closest to ``key`` (difflib ratio >= 0.5), or None."""
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return match[0] if match else None


def _unknown_key_error(key: str, valid: list[str], path: str) -> ValueError:
    full = f"{path}{key}"
    hint = nearest_key(key, valid)
    did_you_mean = f" (did you mean '{path}{hint}'?)" if hint else ""
    return ValueError(f"unknown config key '{full}'{did_you_mean}; valid keys: {', '.join(valid)}")


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it (converted where lossless)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        given = [a for a in args if a is not type(None)]
        if len(given) == 1 and dataclasses.is_dataclass(given[0]):  # an optional section: its own message
            return _coerce(value, given[0], name)
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, name)
            except ValueError:
                continue
        raise ValueError(f"config key '{name}' must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ValueError(f"config key '{name}' must be one of {choices}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"config key '{name}' must be a mapping (section), got {value!r}")
        return from_dict(tp, value, path=f"{name}.")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config key '{name}' must be a list, got {value!r}")
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{name}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"config key '{name}' must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config key '{name}' must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)  # e.g. 1e6 written for a step count
            raise ValueError(f"config key '{name}' must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"config key '{name}' must be a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            # PyYAML follows YAML 1.1, where '3e-4' (no dot) is a string; accept it as the number it means.
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"config key '{name}' must be a number, got {value!r}")
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"config key '{name}' must be a string, got {value!r}")
        return value
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise ValueError(f"config key '{name}' must be {tp.__name__}, got {value!r}")
        return value
    return value  # an annotation we do not check (kept permissive on purpose)


def from_dict(cls: type, d: dict[str, Any] | None, path: str = "") -> Any:
    """Build dataclass ``cls`` from the nested dict ``d``, checking keys and value types.

    Missing keys take the dataclass defaults; an unknown key raises ``ValueError`` naming it and the
    nearest valid key; a value of the wrong type raises ``ValueError`` naming the field and the type
    expected. Nested dataclass fields are filled recursively (``path`` prefixes the names in messages).
    ``__post_init__`` of ``cls`` then validates the values themselves.
    """
    assert dataclasses.is_dataclass(cls), cls
    if path and not path.endswith("."):
        path += "."  # accept "model" as well as "model."
    d = {} if d is None else d
    if not isinstance(d, dict):
        where = f"section '{path[:-1]}'" if path else "the config"
        raise ValueError(f"{where} must be a mapping of key: value, got {d!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in d.items():
        if key not in fields:
            raise _unknown_key_error(str(key), list(fields), path)
        kwargs[key] = _coerce(value, hints[key], f"{path}{key}")
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"config is missing required key(s): {', '.join(path + m for m in missing)}")
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """Dataclass (nested) -> plain dict of YAML-friendly values (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def _parse_scalar(text: str) -> Any:
    """A ``--set`` value as a YAML scalar: ``3`` -> 3, ``true`` -> True, ``null`` -> None, ``[1,2]`` -> list."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text  # not valid YAML (e.g. an unbalanced quote): keep the raw string, type checks follow


def apply_overrides(d: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of nested dict ``d`` with each ``"section.key=value"`` applied.

    Values are parsed as YAML scalars (``1e-3``, ``true``, ``null``, ``[1, 2]``); whether the key exists
    and the value has the right type is checked later by :func:`from_dict`, which names the nearest
    valid key for a typo.
    """
    out = copy.deepcopy(d)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. training.max_steps=100)")
        dotted, text = item.split("=", 1)
        keys = [k.strip() for k in dotted.strip().split(".")]
        if not all(keys):
            raise ValueError(f"override {item!r} has an empty key; use section.key=value")
        node = out
        for i, k in enumerate(keys[:-1]):
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            elif not isinstance(nxt, dict):
                raise ValueError(f"override {item!r}: '{'.'.join(keys[: i + 1])}' is a value, not a section")
            node = nxt
        node[keys[-1]] = _parse_scalar(text)
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from ``path`` (``ValueError`` for a missing file, bad YAML or a non-mapping)."""
    p = check_input_file(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {p} is not UTF-8 text (invalid byte at offset {e.start}); save it as "
                         "UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ValueError(f"config file {p} is not valid YAML{where}: {what}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {p} must hold a mapping (section: {{key: value}}), got {type(data).__name__}")
    return data


def dump_yaml(obj: Any, path: str | Path | None = None) -> str:
    """YAML text of a dataclass or dict (keys in declaration order); written atomically to ``path`` if given."""
    text = yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=False)
    if path is not None:
        atomic_write_text(path, text)
    return text


def diff_dicts(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Flattened differences between two nested dicts: ``[(dotted_key, old_value, new_value), ...]``."""
    out: list[tuple[str, Any, Any]] = []
    for k in list(old) + [k for k in new if k not in old]:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(diff_dicts(a, b, f"{prefix}{k}."))
        elif a != b:
            out.append((f"{prefix}{k}", a, b))
    return out
