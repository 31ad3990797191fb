"""Generic YAML -> dataclass machinery under the recipe schema (`train.config`): typed construction from annotations
and `section.key=value` overrides.

    cfg = build_dataclass(TrainConfig, {"lr": 1e-3}, "train", err)   # err(key, message) raises; runs cfg.validate(err)
    raw = apply_overrides(raw, ["train.lr=1e-3", "eval.baselines=[plain]"], source)

A field's annotation is its check: `int`, `float` (ints and YAML 1.1's dot-less `1e-3` strings accepted), `str`,
`bool`, `Literal[...]`, `X | None`, `list[X]`, `dict`, nested dataclasses, `Any`. Unknown keys, missing required
fields and non-finite floats are refused with the key named. Every dataclass built here is a `Section`: it
declares `validate(err)`, its own checks (nothing to check: a method that returns). Nothing here knows the recipe's
sections.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, Protocol

import yaml


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file and the key. Defined here because the override
    parser raises it; every stage imports it from `train.config`."""


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


MAX_YAML_NODES = 100_000
"""The most YAML nodes a recipe (or pipeline.yaml, or an override's value) may hold with every alias expanded: a
shipped recipe holds a few hundred. Nested aliases ('billion laughs': each level repeating the one below) expand
exponentially, and anything that walks the result (a message quoting a value, saving the resolved recipe) would
never finish."""


class YAMLTooLarge(yaml.YAMLError):
    """A YAML document whose aliases expand past `MAX_YAML_NODES`, or nest too deep; the message says where."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that measures each document before constructing it: its node count with aliases expanded
    (each shared node counted once per reference, computed once per node) must stay within `limit`, and it must not
    refer to itself."""

    limit = MAX_YAML_NODES

    def compose_document(self):
        node = super().compose_document()
        _check_expanded_size(node, self.limit)
        return node


def _check_expanded_size(root: yaml.Node, limit: int) -> None:
    size: dict[int, int] = {}  # id(node) -> expanded node count, once each node is done
    open_: set[int] = set()  # nodes on the current path (a node inside itself: a recursive alias)
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in size:
            continue
        if isinstance(node, yaml.ScalarNode):
            size[id(node)] = 1
            continue
        kids = [x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode) else list(node.value)
        if children_done:
            open_.discard(id(node))
            size[id(node)] = 1 + sum(size[id(k)] for k in kids)
            if size[id(node)] > limit:
                mark = node.start_mark
                raise YAMLTooLarge(
                    f"line {mark.line + 1}, column {mark.column + 1}: aliases expand this node to more than {limit} "
                    "nodes (nested aliases, a 'billion laughs'?); refusing to load it"
                )
            continue
        if id(node) in open_:
            mark = node.start_mark
            raise YAMLTooLarge(f"line {mark.line + 1}, column {mark.column + 1}: a node that contains itself (alias)")
        open_.add(id(node))
        stack.append((node, True))
        for kid in kids:
            if id(kid) not in size:
                if id(kid) in open_:
                    mark = kid.start_mark
                    raise YAMLTooLarge(
                        f"line {mark.line + 1}, column {mark.column + 1}: a node that contains itself (alias)"
                    )
                stack.append((kid, False))


def safe_load(text: str) -> Any:
    """`yaml.safe_load` bounded: YAMLTooLarge for a document whose aliases expand past `MAX_YAML_NODES` nodes, that
    refers to itself, or that nests too deep for the parser; yaml.YAMLError for what is not YAML."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except RecursionError:
        raise YAMLTooLarge("nested too deeply to read") from None
    finally:
        loader.dispose()


def yaml_problem(exc: yaml.YAMLError, lines: bool = True) -> str:
    """One line from a YAML error: where it is (line and column, 1-based; `lines=False` for an override's value: the
    character), what is wrong, and while doing what."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    if mark is None:
        where = ""
    else:
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if lines else f"character {mark.column + 1}: "
    started = getattr(exc, "context_mark", None)
    if context and started is not None and lines:
        context += f" started at line {started.line + 1}, column {started.column + 1}"
    return where + problem + (f" ({context})" if context else "")


def _parse_override(item: str, source: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise RecipeError(f"{source}: override {item!r} must look like section.key=value")
    key, text = item.split("=", 1)
    try:
        return key.strip().split("."), safe_load(text) if text != "" else None
    except YAMLTooLarge as exc:
        raise RecipeError(f"{source}: override {item[:60]!r}: {exc}") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{source}: override {item!r}: not a YAML value: {yaml_problem(exc, lines=False)}") from None


def apply_overrides(raw: dict, overrides: list[str], source: str) -> dict:
    """Set `section.key=value` items (values read as YAML, `key=` is null) in the raw mapping, creating sections as
    needed; return it. Errors name `source` and the item."""
    for item in overrides:
        path, value = _parse_override(item, source)
        node = raw
        for part in path[:-1]:
            if node.get(part) is None:  # absent, or an empty section (`export:` with nothing under it)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise RecipeError(f"{source}: override {item!r}: {part} is not a section")
        node[path[-1]] = value
    return raw
