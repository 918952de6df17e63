"""The package installs and imports both editable and from a wheel; the CLI answers."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import rlflow

ROOT = pathlib.Path(__file__).resolve().parent.parent
IMPORTS = "import rlflow, rlflow.protocol, rlflow.services, rlflow.data.transport; "


def run(*args: str, cwd: pathlib.Path, env: dict | None = None, stderr: bool = False) -> str:
    """What `args` printed (stdout; with `stderr`, both), once it has exited 0."""
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr if stderr else done.stdout


def test_editable_install_maps_the_top_level_folders(tmp_path):
    out = run(
        sys.executable,
        "-c",
        IMPORTS + "print(rlflow.__file__); print(rlflow.protocol.__file__); print(rlflow.services.__file__)",
        cwd=tmp_path,
    )
    assert out.split() == [
        str(ROOT / "rlflow" / "__init__.py"),
        str(ROOT / "protocol" / "__init__.py"),
        str(ROOT / "services" / "__init__.py"),
    ]


@pytest.mark.slow  # builds and installs a wheel
def test_a_wheel_installs_and_imports_all_three(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "runs", "results"),
    )
    built = run(sys.executable, "-m", "pip", "wheel", "--verbose", "--no-deps", "--no-build-isolation",
                "-w", str(tmp_path / "dist"), str(src), cwd=tmp_path, stderr=True)
    # A clean build says nothing but progress: no setuptools warning (a folder of
    # package data that is no declared package, a deprecated setting, ...).
    assert not re.findall(r"\w*Warning: .*", built), re.findall(r"\w*Warning: .*", built)
    (wheel,) = (tmp_path / "dist").glob("rlflow-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "rlflow/protocol/SPEC.md" in names
    assert "rlflow/defaults/default.toml" in names
    packages = {path.parent.relative_to(ROOT).as_posix() for path in (ROOT / "rlflow").rglob("__init__.py")}
    assert {p for p in packages if f"{p}/__init__.py" not in names} == set(), \
        "packages missing from [tool.setuptools] packages in pyproject.toml"
    assert not any(n.startswith(("protocol/", "services/", "tests/", "bench/")) for n in names), \
        "generic top-level names leaked"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "rlflow = rlflow.tools.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    target = tmp_path / "site"
    run(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel),
        cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = run(
        sys.executable,
        "-c",
        IMPORTS + "print(rlflow.__file__); print(rlflow.protocol.__file__); print(rlflow.services.__file__)",
        cwd=tmp_path,
        env=env,
    )
    for path in out.split():
        assert path.startswith(str(target)), f"{path} was not imported from the wheel"


def test_version_and_help():
    rlflow_cli = pathlib.Path(sys.executable).parent / "rlflow"
    assert run(str(rlflow_cli), "--version", cwd=ROOT).strip() == f"rlflow {rlflow.__version__}"
    assert "usage: rlflow" in run(str(rlflow_cli), "--help", cwd=ROOT)


def test_the_protocol_depends_on_nothing_of_the_project():
    """Importing `rlflow.protocol` (and sending a tensor) loads none of the
    project's other layers, nor torch, ZeroMQ, trio or Ray."""
    out = run(
        sys.executable,
        "-c",
        "import sys, numpy as np; import rlflow.protocol as p; p.Tensor.from_numpy(np.zeros(3, np.float32)); "
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'zmq', 'trio', 'ray', 'transformers', 'rlflow'))))",
        cwd=ROOT,
    )
    loaded = set(out.split())
    assert "rlflow.protocol.tensors" in loaded
    assert loaded == {"rlflow"} | {m for m in loaded if m.startswith("rlflow.protocol")}, loaded


def test_a_simulated_run_loads_neither_torch_nor_vllm():
    """The services of a simulated run, with their simulated engines, load neither torch nor vLLM:
    a cluster of 80 simulated replicas on a few cores would spend minutes importing them."""
    modules = ["rlflow.control.placement", "rlflow.services.rollout.service", "rlflow.services.rollout.sim",
               "rlflow.services.reward.service", "rlflow.services.trainer.service", "rlflow.services.trainer.sim",
               "rlflow.services.teacher.service", "rlflow.services.teacher.sim", "rlflow.services.critic.service",
               "rlflow.services.critic.sim"]
    out = run(
        sys.executable,
        "-c",
        f"import sys; import {', '.join(modules)}; "
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers'))))",
        cwd=ROOT,
    )
    assert out.split() == [], out
