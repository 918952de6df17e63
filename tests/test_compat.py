"""The private vLLM and torch internals rlflow touches are all where it
expects them, and a version they were not checked against fails at once."""

from __future__ import annotations

import pytest
import torch

from rlflow.services import compat


@pytest.mark.slow  # imports the whole of torch.distributed
def test_the_torch_internals_are_there():
    assert [p for p in compat.problems() if p.startswith("torch")] == []


@pytest.mark.vllm
def test_the_vllm_internals_are_there():
    assert compat.vllm_version() is not None
    assert compat.problems() == []


def test_an_unchecked_version_fails_naming_both(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "9.1.0+cpu")
    with pytest.raises(compat.IncompatibleVersion, match=r"checked against torch 2\.13; torch 9\.1\.0\+cpu"):
        compat.check_versions()
    monkeypatch.undo()
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.99.0")
    with pytest.raises(compat.IncompatibleVersion, match=r"vLLM 0\.32; vLLM 0\.99\.0 is installed"):
        compat.check_versions()


@pytest.mark.vllm
def test_the_engine_core_side_imports_nothing_of_the_service():
    """vLLM's engine-core process imports `vllm_worker`: of rlflow, only the
    protocol, the weight helpers and the compatibility module come with it
    (no config, no service, no transport)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import sys, rlflow.services.rollout.vllm_worker; "
         "print(' '.join(sorted(m for m in sys.modules if m.startswith('rlflow'))))"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    loaded = {m for m in out.stdout.split() if not m.startswith("rlflow.protocol")}
    assert loaded == {
        "rlflow", "rlflow.data", "rlflow.data.net", "rlflow.services", "rlflow.services.compat",
        "rlflow.services.rollout", "rlflow.services.rollout.vllm_worker", "rlflow.services.weights",
    }
