"""Turning msgspec's validation errors into one line that names the key, the
value given and what is allowed there (`explain`), read off the schema.

msgspec says what failed and where (``Expected `int` >= 1 - at
`$.run.batch_size```); this finds the value in the raw config, the type
declared there (following tagged unions by the ``kind`` given), and
describes that type in words.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from rlflow.config.errors import MISSING, ConfigError
from rlflow.config.schema import Config

_AT = re.compile(r"^(?P<what>.*) - at `\$(?P<path>.*)`$")
_FIELD = re.compile(r"`(?P<name>[^`]+)`")


def explain(exc: msgspec.ValidationError, raw: dict[str, Any]) -> ConfigError:
    """`exc`, met validating `raw`, as a `ConfigError`."""
    text = str(exc)
    match = _AT.match(text)
    what, path = (match["what"], _parse_path(match["path"])) if match else (text, [])
    path = _name_elided_keys(path, raw)
    if path and path[-1] == "kind":
        union = _union_at(path[:-1])
        if union is not None:
            return ConfigError(_join(path), _lookup(raw, path), f"expected {_kinds(union)}")
    if what.startswith(("Object contains unknown field", "Object missing required field")):
        name = _FIELD.search(what)["name"]  # type: ignore[index]
        key_path = path + [name]
        given = _lookup(raw, key_path)
        target = _type_at(path, raw)
        if what.startswith("Object contains unknown field"):
            keys = _keys_of(target)
            return ConfigError(_join(key_path), given, f"unknown key; {_join(path) or 'the top level'} takes: {keys}")
        if name == "kind":
            union = _union_at(path)
            return ConfigError(_join(key_path), MISSING, f"required: {_kinds(union) if union else 'a kind'}")
        field_type = _type_at(key_path, raw)
        return ConfigError(_join(key_path), MISSING, f"required: {describe_type(field_type)}")
    given = _lookup(raw, path)
    target = _type_at(path, raw)
    # A table that checks itself (a __post_init__) says what is wrong in its own words.
    if target is None or (isinstance(target, msgspec.inspect.StructType) and not what.startswith("Expected")):
        return ConfigError(_join(path) or "config", given, what)
    return ConfigError(_join(path), given, f"expected {describe_type(target)}")


def _parse_path(path: str) -> list[str]:
    path = path.replace("[...]", ".\0")
    return [part for part in re.split(r"\.|\[|\]", path) if part]


def _name_elided_keys(path: list[str], raw: Any) -> list[str]:
    """msgspec writes a dict key as ``[...]``: find the entry that fails."""
    out: list[str] = []
    for i, part in enumerate(path):
        if part != "\0":
            out.append(part)
            continue
        table = _lookup(raw, out)
        dict_type = _type_at(out, raw)
        value_type = getattr(dict_type, "value_type", None)
        bad = [k for k, v in (table.items() if isinstance(table, dict) else ()) if not _converts(v, value_type)]
        out.append(bad[0] if bad else part)
    return out


def _converts(value: Any, node: Any) -> bool:
    insp = msgspec.inspect
    kinds: dict[type, type] = {insp.FloatType: float, insp.IntType: int, insp.StrType: str, insp.BoolType: bool}
    kind = kinds.get(type(node))
    kind = node.cls if isinstance(node, insp.StructType) else kind
    if kind is None:
        return True
    try:
        msgspec.convert(value, kind, strict=False)
    except msgspec.ValidationError:
        return False
    return True


def _union_at(path: list[str]) -> Any:
    """The tagged union declared at `path`, if that is what it is."""
    insp = msgspec.inspect
    node, _ = walk(path)
    if isinstance(node, insp.UnionType) and any(getattr(m, "tag", None) for m in node.types):
        return node
    if isinstance(node, insp.StructType) and node.tag is not None:  # a union of one
        return insp.UnionType(types=(node,))
    return None


def _kinds(union: Any) -> str:
    tags = [m.tag for m in union.types if getattr(m, "tag", None) is not None]
    return "one of " + ", ".join(repr(t) for t in tags)


def _join(path: list[str]) -> str:
    return ".".join(path)


def _lookup(raw: Any, path: list[str]) -> Any:
    node = raw
    for part in path:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return MISSING
    return node


def _type_at(path: list[str], raw: Any) -> msgspec.inspect.Type | None:
    """The declared type at `path` (following tagged unions by the given kind)."""
    node, _ = walk(path, raw)
    return _strip(node, _lookup(raw, path))


def walk(path: list[str], raw: Any = MISSING) -> tuple[Any, Any]:
    """The declared type at `path` in `Config`, and the struct field it is
    (None inside tables and lists). A tagged union is followed by the kind
    `raw` gives there, or, with no data, by its first member."""
    insp = msgspec.inspect
    node: Any = insp.type_info(Config)
    field = None
    for i, part in enumerate(path):
        node = _strip(node, _lookup(raw, path[:i]))
        if isinstance(node, insp.StructType):
            field = next((f for f in node.fields if f.encode_name == part), None)
            node = field.type if field is not None else None
        elif isinstance(node, insp.DictType):
            node, field = node.value_type, None
        elif isinstance(node, (insp.ListType, insp.VarTupleType)):
            node, field = node.item_type, None
        else:
            return None, None
    return node, field


def _strip(node: Any, value: Any) -> Any:
    """Drop None from optional types; pick a tagged union's member by `kind`
    (with no data, its first member)."""
    insp = msgspec.inspect
    if isinstance(node, insp.UnionType):
        members = [m for m in node.types if not isinstance(m, insp.NoneType)]
        structs = [m for m in members if isinstance(m, insp.StructType)]
        if structs and isinstance(value, dict) and "kind" in value:
            chosen = [m for m in structs if m.tag == value["kind"]]
            if chosen:
                return chosen[0]
        if len(members) == 1:
            return members[0]
        if value is MISSING and structs:
            return structs[0]
    return node


def _keys_of(node: Any) -> str:
    if isinstance(node, msgspec.inspect.StructType):
        return ", ".join(f.encode_name for f in node.fields if f.encode_name != "kind")
    return "(no keys)"


def describe_type(node: Any) -> str:
    """A type from `msgspec.inspect` in words ("an integer >= 1", "one of ...")."""
    insp = msgspec.inspect
    if isinstance(node, insp.IntType):
        return "an integer" + _bounds(node)
    if isinstance(node, insp.FloatType):
        return "a number" + _bounds(node)
    if isinstance(node, insp.StrType):
        return "a string"
    if isinstance(node, insp.BoolType):
        return "true or false"
    if isinstance(node, insp.LiteralType):
        return "one of " + ", ".join(repr(v) for v in node.values)
    if isinstance(node, insp.DictType):
        return f"a table of {describe_type(node.value_type)}"
    if isinstance(node, (insp.ListType, insp.VarTupleType)):
        return f"a list of {describe_type(node.item_type)}"
    if isinstance(node, insp.StructType):
        if node.tag is not None:
            return f"a table with kind = {node.tag!r} and keys: {_keys_of(node)}"
        return f"a table with keys: {_keys_of(node)}"
    if isinstance(node, insp.UnionType):
        kinds = [repr(m.tag) for m in node.types if isinstance(m, insp.StructType) and m.tag is not None]
        if kinds:
            return "a table whose kind is one of " + ", ".join(kinds)
        return " or ".join(describe_type(m) for m in node.types if not isinstance(m, insp.NoneType))
    return str(node)


def _bounds(node: Any) -> str:
    parts = []
    for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        value = getattr(node, attr, None)
        if value is not None:
            parts.append(f"{sign} {value:g}")
    return (" " + " and ".join(parts)) if parts else ""
