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
    """vLLM's engine-core process imports `vllm_lora_worker` (and with it
    `vllm_worker`): of rlflow, only the protocol, the weight helpers and the
    compatibility module come with them (no config, no service, no transport)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import sys, rlflow.services.rollout.vllm_lora_worker; "
         "print(' '.join(sorted(m for m in sys.modules if m.startswith('rlflow'))))"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    loaded = {m for m in out.stdout.split() if not m.startswith("rlflow.protocol")}
    assert loaded == {
        "rlflow", "rlflow.data", "rlflow.data.net", "rlflow.services", "rlflow.services.compat",
        "rlflow.services.rollout", "rlflow.services.rollout.vllm_lora_worker", "rlflow.services.rollout.vllm_worker",
        "rlflow.services.weights",
    }


def test_a_groups_port_is_held_from_its_offer_until_the_group_forms_over_it():
    """The port rank 0 offers is bound from the offer on (nothing else can take
    it while the receivers start); a receiver that comes early waits, and the
    group forms over the held socket."""
    import socket
    import threading

    from rlflow.data.net import hold_port, listener, take_held
    from rlflow.services.weights import GlooGroup

    held = listener("127.0.0.1")
    port = held.getsockname()[1]
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    box: dict = {}
    receiver = threading.Thread(target=lambda: box.setdefault("group", GlooGroup("127.0.0.1", port, 1, 2, 30)),
                                daemon=True)
    receiver.start()
    receiver.join(0.5)  # connected to the held socket, waiting for its store to serve
    assert receiver.is_alive()
    sender = GlooGroup("127.0.0.1", port, 0, 2, 30, listener=held)
    receiver.join(30)
    out = torch.zeros(4)
    receiving = threading.Thread(target=lambda: box["group"].broadcast(out, 0), daemon=True)
    receiving.start()
    sender.broadcast(torch.arange(4.0))
    receiving.join(30)
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert held.fileno() == -1  # the store's now

    port = hold_port("127.0.0.1")
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    taken = take_held(port)
    assert taken is not None and taken.getsockname()[1] == port and take_held(port) is None
    taken.close()
