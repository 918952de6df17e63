"""Write the message-layout tables of SPEC.md from the Structs themselves.

`python -m rlflow.protocol.spec` prints them, `--write` replaces them in
SPEC.md; a test checks that SPEC.md holds exactly this text between its
markers, so the document cannot drift from the code.
"""

from __future__ import annotations

import ast
import enum
import inspect
import pathlib
import sys
import textwrap

import msgspec

from .messages import (
    CONTROLLER_ERROR_KINDS, MESSAGE_TYPES, WEIGHT_GROUP_BROKEN, AdapterUpdate, FinishReason, Record, Role, Stage,
)
from .shm import CONTROL_BYTES, CONTROL_FIELDS
from .tensors import DTYPE_SIZES, Tensor

BEGIN = "<!-- BEGIN GENERATED: python -m rlflow.protocol.spec -->"
END = "<!-- END GENERATED -->"


def _type_name(t: msgspec.inspect.Type) -> str:
    insp = msgspec.inspect
    if isinstance(t, insp.IntType):
        bounds = [f">= {t.ge}"] if t.ge is not None else []
        return "int" + (f" ({', '.join(bounds)})" if bounds else "")
    if isinstance(t, insp.FloatType):
        return "float64" + (f" (>= {t.ge})" if t.ge is not None else "")
    if isinstance(t, insp.StrType):
        return "str"
    if isinstance(t, insp.BoolType):
        return "bool"
    if isinstance(t, insp.NoneType):
        return "nil"
    if isinstance(t, insp.EnumType):
        return f"int ({t.cls.__name__})"
    if isinstance(t, (insp.ListType, insp.VarTupleType)):
        return f"array of {_type_name(t.item_type)}"
    if isinstance(t, insp.DictType):
        return f"map {_type_name(t.key_type)} -> {_type_name(t.value_type)}"
    if isinstance(t, insp.UnionType):
        return " or ".join(_type_name(m) for m in t.types)
    if isinstance(t, insp.CustomType) and t.cls is Tensor:
        return "tensor"
    if isinstance(t, insp.StructType):
        return t.cls.__name__
    if isinstance(t, insp.AnyType):
        return "any msgpack value"
    raise NotImplementedError(repr(t))


def _default(field: msgspec.inspect.Field) -> str:
    """A field's default in the notation of *Fields, defaults, numbers*: msgpack's values, not Python's."""
    if field.required:
        return "required"
    value = field.default_factory() if field.default_factory is not msgspec.NODEFAULT else field.default
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, msgspec.Struct):
        return f"a `{type(value).__name__}` of defaults"
    if value is None:
        return "`nil`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, (list, tuple)) and not value:
        return "`[]` (empty array)"
    if isinstance(value, dict) and not value:
        return "`{}` (empty map)"
    return f"`{value!r}`"


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field in the class body (or in a base's)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if issubclass(klass, msgspec.Struct) and klass is not msgspec.Struct:
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, following in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(following.value.value.split())
    return docs


def _table(cls: type) -> list[str]:
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)  # the spec's tables are of messages and records
    docs = field_docs(cls)
    lines = ["| # | field | type | default | meaning |", "| --- | --- | --- | --- | --- |"]
    first = 0
    if info.tag is not None:
        lines.append(f"| 0 | (tag) | int | `{info.tag}` | |")
        first = 1
    for i, field in enumerate(info.fields, start=first):
        meaning = docs.get(field.name, "").replace("|", "\\|")
        lines.append(f"| {i} | `{field.name}` | {_type_name(field.type)} | {_default(field)} | {meaning} |")
    return lines


def generate() -> str:
    """The generated part of SPEC.md."""
    out = [BEGIN, "", "### Messages", ""]
    for tag, cls in sorted(MESSAGE_TYPES.items()):
        out += [f"#### {cls.__name__} (tag {tag})", "", _doc(cls), "", *_table(cls), ""]
    out += ["### Embedded records", "", "Records have no tag of their own, except the members of a union, whose tag "
            "is their first element and is unique within the union.", ""]
    for cls in sorted(_records(), key=lambda c: c.__name__):
        out += [f"#### {cls.__name__}", "", _doc(cls), "", *_table(cls), ""]
    out += ["### Error kinds", "", "`ErrorReport.kind` values with a meaning of their own (a replica's fatal report "
            "may also name the type of the error that ended it):", "", "| kind | fatal | from | when |",
            "| --- | --- | --- | --- |"]
    out += [f"| `{kind}` | true | controller | {meaning} |" for kind, meaning in CONTROLLER_ERROR_KINDS.items()]
    out += [f"| `{WEIGHT_GROUP_BROKEN}` | false | trainer, rollout | a weight broadcast failed (a member of the "
            "collective group died mid-way): the group must be made anew |", ""]
    out += ["### Enumerations", ""]
    for enum_cls in (Role, FinishReason, Stage, AdapterUpdate):
        members = ", ".join(f"{m.name} = {m.value}" for m in enum_cls)
        out += [f"- `{enum_cls.__name__}`: {members}"]
    out += ["", "### Tensor dtypes", "", "| name | bytes per element |", "| --- | --- |"]
    out += [f"| `{name}` | {size} |" for name, size in DTYPE_SIZES.items()]
    out += ["", "### Shared-memory control page", "",
            f"The first {CONTROL_BYTES:,} bytes of every segment (the rest of the page is zero). Integers are "
            "unsigned, 64 bits, little-endian, each written and read whole.", "",
            "| offset | bytes | field | written by | holds |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {f.offset} | {f.size} | `{f.name}` | {f.writer} | {f.meaning} |" for f in CONTROL_FIELDS]
    out += ["", END]
    return "\n".join(out)


def _records() -> list[type]:
    """Every record that is sent (bases whose name starts with _ are not)."""
    out, todo = [], list(Record.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if not cls.__name__.startswith("_"):
            out.append(cls)
    return out


def _doc(cls: type) -> str:
    """A class's whole docstring, as one paragraph."""
    return " ".join((cls.__doc__ or "").split())


def write(path: pathlib.Path) -> None:
    """Replace the generated part of the document at `path`."""
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    path.write_text(text[:start] + generate() + text[end:])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write(pathlib.Path(__file__).with_name("SPEC.md"))
    else:
        print(generate())
