"""Generic YAML machinery under the recipe schema (`schema.recipe`): bounded YAML reading and `section.key=value`
overrides; typed construction of the sections is `models.typed.build_dataclass` (exports are read with it too).

    raw = apply_overrides(raw, ["train.lr=1e-3", "eval.baselines=[plain]"], source)

Nothing here knows the recipe's sections.
"""

from __future__ import annotations

from typing import Any

import yaml


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file and the key. Defined here because the override
    parser raises it; every stage imports it from `schema.recipe`."""


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
