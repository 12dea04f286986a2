"""Parsing a job spec's YAML text, safely: no code runs, no key is repeated, no alias
bomb, and ``3e-4`` is a number.

:func:`roundpipe.coordinator.spec.jobspec.load_job_spec` reads the file (size, UTF-8) and
hands the text here.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

__all__ = [
    "EXPONENT_NUMBER",
    "MAX_SPEC_NODES",
    "SpecYamlError",
    "number_string_hint",
    "parse_spec_yaml",
]

EXPONENT_NUMBER = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
"""A number in exponent form (``3e-3``, ``1.5E6``), with or without a dot or a sign in
the exponent."""


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``3e-4`` as a float.

    YAML 1.1 (PyYAML) only reads exponent floats that contain a dot (``3.0e-4``), so
    ``lr: 3e-4`` would otherwise arrive as the string ``"3e-4"``. The resolver table is
    copied, so the global SafeLoader is untouched.
    """


_YamlLoader.yaml_implicit_resolvers = {
    k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_NUMBER, list("-+0123456789"))


# Note [YAML 1.1 numbers]
# load_job_spec reads `lr: 3e-3` as a number, but other YAML 1.1 loaders (PyYAML's
# yaml.safe_load, ruamel in 1.1 mode) read an exponent without a dot, or without a sign
# after the e, as a string. A user who loads a spec that way and submits the dict gets
# "expected a number" for what looks like one; the message then names the trap
# (number_string_hint). The shipped examples write numbers every loader reads (0.003).


def number_string_hint(value: Any) -> str | None:
    """For a string that a YAML 1.1 loader left unread as a number, such as ``'3e-3'``:
    why, and how to write it so that every loader reads a number. None otherwise."""
    if not isinstance(value, str) or not EXPONENT_NUMBER.match(value):
        return None
    mantissa, _, exponent = value.lower().partition("e")
    missing = []
    if "." not in mantissa:
        missing.append("a dot")
        mantissa += ".0"
    elif mantissa.endswith("."):
        mantissa += "0"
    if exponent[0] not in "+-":
        missing.append("a sign after the e")
        exponent = "+" + exponent
    if not missing:
        return None  # a YAML 1.1 float already: the string came from elsewhere (quotes)
    spellings = [f"{mantissa}e{exponent}"]
    plain = repr(float(value.replace("_", "")))
    if "e" not in plain and "inf" not in plain:
        spellings.append(plain)
    return (
        f"YAML 1.1 loaders such as PyYAML read {value} without {' and '.join(missing)} as a "
        f"string; write {' or '.join(spellings)}"
    )


MAX_SPEC_NODES = 100_000
"""Most values (scalars, lists, maps) a YAML spec may expand to, aliases expanded. A real
spec has a few hundred; ten nested aliases of ten make 10**10 (the "billion laughs"),
which PyYAML builds as shared objects but everything after it copies out, to gigabytes."""


class SpecYamlError(Exception):
    """A problem of the YAML text itself, with its line; becomes a JobSpecError."""


def _where(mark: yaml.Mark | None) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"


def _construct_mapping_once(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    # YAML says keys are unique, but PyYAML keeps the last of duplicates silently: an
    # `lr:` written twice would train with whichever came last.
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<:` merges: PyYAML's own rules apply
        key = loader.construct_object(key_node, deep=False)
        try:
            first = seen.get(key)
        except TypeError:
            continue  # an unhashable key: PyYAML reports it below
        if first is not None:
            raise SpecYamlError(
                f"duplicate key {key!r} at {_where(key_node.start_mark)} (first at "
                f"{_where(first.start_mark)}); each key may appear once in a mapping: "
                "remove one of them"
            )
        seen[key] = key_node
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_YamlLoader.add_constructor("tag:yaml.org,2002:map", _construct_mapping_once)
_YamlLoader.construct_mapping = _construct_mapping_once  # type: ignore[assignment,method-assign]


def _expanded_size(root: yaml.Node) -> int:
    """How many nodes ``root`` stands for once every alias is expanded, stopping as soon
    as that passes MAX_SPEC_NODES (each distinct node is sized once, so this is cheap)."""
    sizes: dict[int, int] = {}
    # Iterative post-order walk: a deeply nested document must not hit the recursion limit.
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            sizes[id(node)] = 1
            continue
        if not children_done:
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        total = 1 + sum(sizes.get(id(c), 1) for c in children)
        if total > MAX_SPEC_NODES:
            raise SpecYamlError(
                f"the value at {_where(node.start_mark)} expands to more than "
                f"{MAX_SPEC_NODES} values (aliases of aliases); a job spec needs a few "
                "hundred: write the values out, or use fewer aliases"
            )
        sizes[id(node)] = total
    return sizes.get(id(root), 0)


def parse_spec_yaml(text: str) -> Any:
    loader = _YamlLoader(text)  # a SafeLoader subclass: no code runs
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()
