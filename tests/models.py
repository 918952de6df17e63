"""Tiny models for tests, built in a second, never downloaded."""

from __future__ import annotations

from rlflow.models import random_arith_model as tiny_model

__all__ = ["tiny_model"]
