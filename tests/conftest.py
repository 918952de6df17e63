"""Shared fixtures. Expensive ones (Ray, vLLM) are session-scoped."""

from __future__ import annotations

import os
import sys

# Helpers beside the tests (golden.py, strategies.py, peers.py) import by name.
sys.path.insert(0, os.path.dirname(__file__))

from hypothesis import settings  # noqa: E402

# This machine is shared and noisy: time limits per example would make
# property tests flaky without testing anything about correctness.
settings.register_profile("rlflow", deadline=None)
settings.load_profile("rlflow")
