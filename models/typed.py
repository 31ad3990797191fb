"""Typed construction of plain dataclasses from parsed YAML / JSON: the recipe schema's sections (`schema.recipe`) and
the drafter configs an export records (`models.io`) are built and checked by it.

    cfg = build_dataclass(Eagle3Config, {"draft_vocab": 8000}, "drafter", err)   # err(key, message) raises

A field's annotation is its check: `int`, `float` (ints and YAML 1.1's dot-less `1e-3` strings accepted), `str`,
`bool`, `Literal[...]`, `X | None`, `list[X]`, `dict`, nested dataclasses, `Any`. Unknown keys, missing required
fields and non-finite floats are refused with the key named. Every dataclass built here is a `Section`: it
declares `validate(err)`, its own checks (nothing to check: a method that returns).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, Protocol


class Section(Protocol):
    """A dataclass `build_dataclass` builds: once its fields are typed, it checks them (`err(key, message)` raises)."""

    def validate(self, err) -> None: ...


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, err) -> Any:
    """Check `value` against annotation `tp`; return it (ints are accepted for floats)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, _raise_plain)
            except _Mismatch:
                continue
        err(key, f"expected {' | '.join(_type_name(a) for a in args)}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        if value is False and "no" in args:  # YAML 1.1 reads an unquoted `no` as false
            value = "no"
        if value not in args:
            err(key, f"must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            err(key, f"expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]", err) for i, v in enumerate(value)] if args else value
    if origin is dict:
        if not isinstance(value, dict):
            err(key, f"expected a mapping, got {type(value).__name__} {value!r}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 reads `1e-3` (no dot) as a string; accept what Python reads as a number.
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            err(key, f"expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, key, err)
    raise TypeError(f"unsupported annotation {tp!r} for {key}")


class _Mismatch(Exception):
    pass


def _raise_plain(key: str, msg: str) -> typing.NoReturn:
    raise _Mismatch(msg)


def build_dataclass(cls: type[Section], raw: Any, prefix: str, err) -> Any:
    """Build dataclass `cls` from a mapping, checking keys and types; then run its `validate`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        err(prefix, f"expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        err(f"{prefix}.{unknown[0]}", f"unknown key (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(value, hints[name], f"{prefix}.{name}", err)
        for i, number in enumerate(kwargs[name] if isinstance(kwargs[name], list) else [kwargs[name]]):
            if isinstance(number, float) and not math.isfinite(number):  # YAML `.nan` / `.inf`, override `lr=nan`
                where = f"{prefix}.{name}" + (f"[{i}]" if isinstance(kwargs[name], list) else "")
                err(where, f"must be a finite number, got {number}")
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        err(f"{prefix}.{missing[0]}", "is required")
    obj = cls(**kwargs)
    obj.validate(err)
    return obj
