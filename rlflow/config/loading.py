"""Reading a config: TOML text, then `--set a.b=c` overrides on the same raw
tables, then one validation of the whole (the overrides go through the same
checks as the file); and writing the resolved config back as TOML.

`build` makes a config in code the same way from plain tables (dicts merged
onto a base, a shipped file's as read by `read_toml` or one of the caller's):
what a bench or a test writes instead of TOML text edited by `str.format` and
`.replace`.
"""

from __future__ import annotations

import datetime
import pathlib
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import tomli_w

from rlflow.config.checks import check
from rlflow.config.errors import ConfigError
from rlflow.config.explain import explain, walk
from rlflow.config.schema import Config, RolesConfig, struct_classes


def default_config_path() -> pathlib.Path:
    """The embedded default config (`rlflow up` with no --config)."""
    return pathlib.Path(__file__).resolve().parent.parent / "defaults" / "default.toml"


def load(path: str | pathlib.Path | None = None, overrides: Sequence[str] = (), *,
         text: str | None = None) -> Config:
    """Read, override and validate a config (from `path`, or `text`)."""
    if text is None:
        if path is None:
            raise ValueError("load() needs a path or text")
        raw = read_toml(path)
    else:
        raw = _parse(text, str(path or "<config>"))
    return _resolve(raw, overrides)


def read_toml(path: str | pathlib.Path) -> dict[str, Any]:
    """The raw tables of a TOML file, not yet validated: a base for `build`
    (``build(read_toml(path), {...})``). A file that cannot be read or is not
    TOML raises the one-line `ConfigError` that `load` would."""
    try:
        text = pathlib.Path(path).read_text()
    except OSError as exc:
        raise ConfigError("--config", str(path), f"cannot be read ({exc.strerror})") from None
    return _parse(text, str(path))


def _parse(text: str, name: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(name, "(file)", f"is not valid TOML: {exc}") from None


def build(*tables: Mapping[str, Any], overrides: Sequence[str] = ()) -> Config:
    """A config made in code from plain tables: `tables` merged left to right
    (as `merged`), then `overrides` (``a.b.c=value``, as ``--set``), then
    validated as `load` validates a file. What benches and tests use instead
    of TOML text: the same tables written as a TOML file and loaded with the
    same overrides give an equal config, and a bad value raises the same
    one-line `ConfigError` naming its key. The tables given are not changed."""
    return _resolve(merged(*tables), overrides)


def merged(*tables: Mapping[str, Any]) -> dict[str, Any]:
    """`tables` deep-merged left to right into a new dict: a table (a mapping)
    merges key by key into the table it meets; any other value (a number, a
    string, a list) replaces what was there; a value of None removes the key,
    so that a later table can drop an earlier one's (a role, a pool, a bound).
    Nothing of the result is shared with the tables given."""
    out: dict[str, Any] = {}
    for table in tables:
        _merge_into(out, table)
    return out


def _merge_into(into: dict[str, Any], table: Mapping[str, Any]) -> None:
    for key, value in table.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge_into(into[key], value)
        else:
            into[key] = _copy(value)


def _copy(value: Any) -> Any:
    """A copy of plain data, its tables as dicts without their None values, its arrays as lists."""
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_copy(v) for v in value]
    return value


def _resolve(raw: dict[str, Any], overrides: Sequence[str]) -> Config:
    """Apply `overrides` to `raw` (changed in place) and validate the whole."""
    mode = _mode(raw)
    keys = [apply_override(raw, item) for item in overrides]
    _refuse_renamed(raw)
    if _mode(raw) not in (mode, None) and not any(key in ("run", "run.max_staleness") for key in keys):
        # The mode implies its staleness: the file's bound was for the mode it named.
        raw["run"].pop("max_staleness", None)
    return from_dict(raw)


def _renamed() -> dict[str, tuple[str, str]]:
    """Every key given a new name, old -> (new, why), each role's from its table (`RoleTable.renamed`)."""
    out = {}
    roles = msgspec.inspect.type_info(RolesConfig)
    assert isinstance(roles, msgspec.inspect.StructType)
    for field in roles.fields:
        for table in struct_classes(field.type):
            for old, (new, why) in getattr(table, "renamed", {}).items():
                out[f"roles.{field.encode_name}.{old}"] = (f"roles.{field.encode_name}.{new}", why)
    return out


#: Keys renamed: old -> (new, why). A config with the old name is refused, naming the new.
RENAMED = _renamed()


def _refuse_renamed(raw: dict[str, Any]) -> None:
    for old, (new, why) in RENAMED.items():
        *path, last = old.split(".")
        table: Any = raw
        for part in path:
            table = table.get(part) if isinstance(table, dict) else None
        if isinstance(table, dict) and last in table:
            raise ConfigError(old, table[last], f"is now {new} ({why}); rename the key")


def _mode(raw: dict[str, Any]) -> Any:
    """`run.mode` as `raw` gives it (the default if it does not)."""
    run = raw.get("run", {})
    return run.get("mode", "async") if isinstance(run, dict) else None


def from_dict(raw: dict[str, Any]) -> Config:
    """Validate a config given as plain data."""
    try:
        config = msgspec.convert(raw, Config, strict=False)
    except msgspec.ValidationError as exc:
        raise explain(exc, raw) from None
    check(config)
    return config


def apply_override(raw: dict[str, Any], item: str) -> str:
    """Apply one ``a.b.c=value`` (the value read as a TOML value, else a
    string); the key set (``a.b.c``)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item}", item, "expected KEY.PATH=VALUE")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    table = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if part not in table:
            # A table that only has defaults so far: start from the default,
            # so that one of its keys can be set on its own.
            table[part] = _default_table(parts[: i + 1])
        node = table[part]
        if not isinstance(node, dict):
            raise ConfigError(".".join(parts[: i + 1]), node, f"is not a table, so {key} cannot be set")
        table = node
    table[parts[-1]] = value
    return key


def _default_table(path: list[str]) -> dict[str, Any]:
    """The default value at `path` as a plain table ({} if it has none)."""
    _, field = walk(path)
    default = field.default if field is not None else None
    if isinstance(default, msgspec.Struct):
        return _drop_none(msgspec.to_builtins(default))
    return {}


def resolve_run_dir(config: Config, override: str | None = None, now: datetime.datetime | None = None) -> pathlib.Path:
    """The run directory, with ``{time}`` filled in."""
    template = override or config.run.run_dir
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return pathlib.Path(template.replace("{time}", stamp))


def to_toml(config: Config) -> str:
    """The resolved config as TOML (unset optional tables are left out)."""
    return tomli_w.dumps(_drop_none(msgspec.to_builtins(config)))


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value
