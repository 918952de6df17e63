"""The default model's builder: its progress never goes back."""

from __future__ import annotations

import pytest

from rlflow.models import BuildProgress, Recipe, build_default


def test_progress_never_goes_back_while_dev_accuracy_wobbles():
    recipe = Recipe(target_accuracy=0.5, max_steps=1000)
    shown = BuildProgress(recipe)
    # Dev accuracy as a warm start measures it: rising, with noise (7% then 6%).
    accuracies = [0.0, 0.0, 0.035, 0.03, 0.1, 0.07, 0.2, 0.15, 0.3, 0.29, 0.45, 0.5]
    reports = [shown.update(step, accuracy, loss=1.0) for step, accuracy in enumerate(accuracies, 1)]
    fractions = [fraction for _, fraction in reports]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert fractions[3] == fractions[2] == 0.035 / 0.5  # accuracy fell: the bar holds
    text, _ = reports[3]
    assert text == "warm start: step 4 (at most 1000), dev accuracy 3.0% (best 3.5%, target 50%), loss 1.000"
    # With no accuracy yet, the steps move it.
    assert BuildProgress(recipe).update(250, 0.0, loss=1.0)[1] == 0.25


@pytest.mark.slow  # a real (tiny) warm start: torch, generation, ~10-20 s
def test_a_small_build_reports_progress_in_order_and_ends_at_one(tmp_path):
    recipe = Recipe(hidden=32, layers=1, heads=1, ffn=64, max_steps=4, eval_every=2, dev_size=2, batch=4)
    seen: list[tuple[str, float]] = []
    out = build_default(tmp_path / "model", recipe, progress=lambda text, fraction: seen.append((text, fraction)))
    assert (out / "config.json").exists()
    fractions = [fraction for _, fraction in seen]
    assert len(seen) >= 2 and fractions == sorted(fractions) and fractions[-1] == 1.0
    assert seen[0][0].startswith("warm start: step 1 (at most 4), dev accuracy")
