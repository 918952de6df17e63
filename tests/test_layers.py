"""The packages form layers: no module imports from a package above its own
(function-level imports included), and every module's package has a layer."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The layer order, lowest first. A package (or top-level module) of rlflow may
# import from the layers below its own only: not from its own layer's other
# entries, not from above. docs/developing.md says the same in words.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("rlflow",),  # the package root: its version
    ("rlflow.protocol",),
    ("rlflow.data", "rlflow.algo", "rlflow.errors", "rlflow.roles", "rlflow.sandbox", "rlflow.workers"),
    ("rlflow.rewards", "rlflow.rundir"),
    ("rlflow.config", "rlflow.runstate", "rlflow.timeline"),
    ("rlflow.tasks", "rlflow.distributions", "rlflow.startup"),
    ("rlflow.env", "rlflow.models"),
    ("rlflow.taskmodel",),  # a model for a task: the task, its reward functions, the default model's parts
    ("rlflow.control",),
    ("rlflow.tools",),
    ("rlflow.__main__",),
    ("rlflow.services",),  # protocol <- rlflow <- services: nothing of rlflow's imports a service (but a role's tables)
)
LAYER = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}

# The folders of the import names that are no folder of that name.
FOLDERS = {"rlflow": "rlflow", "rlflow.protocol": "protocol", "rlflow.services": "services"}


def modules() -> dict[str, pathlib.Path]:
    """Every module of rlflow/, protocol/ and services/, by its import name."""
    found = {}
    for name, folder in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found[".".join([name, *(p for p in parts if p != "__init__")])] = path
    return found


def unit(module: str) -> str:
    """The entry of LAYERS that `module` belongs to: rlflow's package or
    top-level module it is in (``rlflow.config.schema`` -> ``rlflow.config``);
    a role's tables in its folder are the config's (``rlflow.services.critic.config``)."""
    parts = module.split(".")
    if parts[:2] == ["rlflow", "services"] and len(parts) == 4 and parts[3] == "config":
        return "rlflow.config"
    return ".".join(parts[:2])


def imports(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The project's modules that `module` imports, anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            # `from rlflow import config` imports the module rlflow.config
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(name for name in names if name == "rlflow" or name.startswith("rlflow."))
    return out


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import in `graph` (module -> modules it imports) that does not go
    to a layer below the importer's, as "importer (its entry) imports imported (its entry)"."""
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            here, there = unit(module), unit(target)
            if here != there and LAYER[there] >= LAYER[here]:
                where = "the same layer" if LAYER[there] == LAYER[here] else "a layer above"
                bad.append(f"{module} ({here}) imports {target} ({there}, {where})")
    return bad


def test_every_package_has_a_layer():
    assert sorted({unit(m) for m in modules()} - set(LAYER)) == [], "add these to LAYERS"


def test_no_module_imports_from_its_own_layer_or_above():
    known = modules()
    graph = {m: imports(m, p, set(known)) for m, p in known.items() if unit(m) in LAYER}
    assert upward(graph) == []


def test_an_upward_import_is_named(tmp_path):
    """The check itself: an import inside a function, of a package above, is caught and named."""
    source = tmp_path / "schema.py"
    source.write_text("def f():\n    from rlflow.env import core\n")
    found = imports("rlflow.config.schema", source, {"rlflow.env", "rlflow.env.core"})
    assert found == {"rlflow.env.core"}
    assert upward({"rlflow.config.schema": found}) == [
        "rlflow.config.schema (rlflow.config) imports rlflow.env.core (rlflow.env, a layer above)"]
