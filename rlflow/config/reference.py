"""The configuration reference (docs/configuration.md), written from the
config's own Structs and field docstrings.

`python -m rlflow.config.reference` prints it, `--write` replaces the
generated part of docs/configuration.md; a test checks that the page holds
exactly this text, so the reference cannot drift from the code.
"""

from __future__ import annotations

import enum
import math
import pathlib
import sys

import msgspec

from rlflow.config.explain import describe_type
from rlflow.config.schema import Config, field_docs, struct_classes

BEGIN = "<!-- BEGIN GENERATED: python -m rlflow.config.reference -->"
END = "<!-- END GENERATED -->"
#: The page, from the repository's root.
PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _default(field: msgspec.inspect.Field) -> str:
    if field.required:
        return "required"
    value = field.default_factory() if field.default_factory is not msgspec.NODEFAULT else field.default
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, msgspec.Struct):
        tag = value.__struct_config__.tag
        return f"kind `{tag}`" if tag else "its defaults"
    if isinstance(value, float) and math.isinf(value):
        return "`inf`"
    if value is None:
        return "none"
    text = repr(value).replace("|", "\\|")
    return f"`{text}`" if len(text) < 40 else "see below"


def _tables(cls: type, key: str, out: list[tuple[str, type]], seen: set[tuple[str, type]]) -> None:
    """Every table under `cls` at `key`, depth first (a tagged union: each kind)."""
    if (key, cls) in seen:
        return
    seen.add((key, cls))
    out.append((key, cls))
    for field in _struct_info(cls).fields:
        for member in struct_classes(field.type):
            sub = f"{key}.{field.encode_name}" if key else field.encode_name
            if isinstance(field.type, msgspec.inspect.DictType):
                sub += ".NAME"
            elif isinstance(field.type, (msgspec.inspect.ListType, msgspec.inspect.VarTupleType)):
                sub = f"[[{sub}]]"
            _tables(member, sub, out, seen)


def _struct_info(cls: type) -> msgspec.inspect.StructType:
    info = msgspec.inspect.type_info(cls)
    if not isinstance(info, msgspec.inspect.StructType):
        raise TypeError(f"{cls!r} is not a table")
    return info


def _kind(field: msgspec.inspect.Field, key: str) -> str:
    """A field's type in words; a table names where it is described."""
    insp, node = msgspec.inspect, field.type
    if isinstance(node, insp.UnionType):
        node = next((m for m in node.types if not isinstance(m, insp.NoneType)), node) \
            if sum(not isinstance(m, insp.NoneType) for m in node.types) == 1 else node
    if isinstance(node, insp.StructType):
        return f"a table (`{key}`)"
    if isinstance(node, insp.DictType) and isinstance(node.value_type, insp.StructType):
        return f"tables by name (`{key}.NAME`)"
    return describe_type(field.type)


def generate() -> str:
    """The generated part of docs/configuration.md."""
    tables: list[tuple[str, type]] = []
    _tables(Config, "", tables, set())
    out = [BEGIN, ""]
    for key, cls in tables:
        info = _struct_info(cls)
        title = key or "(the top level)"
        if info.tag is not None:
            title += f" (kind = \"{info.tag}\")"
        doc = " ".join((cls.__doc__ or "").split())
        out += [f"### `{title}`", "", doc, "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        docs = field_docs(cls)
        for field in info.fields:
            meaning = docs.get(field.name, "").replace("|", "\\|")
            kind = _kind(field, f"{key}.{field.encode_name}" if key else field.encode_name).replace("|", "\\|")
            out.append(f"| `{field.encode_name}` | {kind} | {_default(field)} | {meaning} |")
        out.append("")
    out.append(END)
    return "\n".join(out)


def write(path: pathlib.Path = PAGE) -> None:
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    path.write_text(text[:start] + generate() + text[end:])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(generate())
