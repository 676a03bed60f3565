"""The learning-rate schedule against its definition: warmup, then cosine / linear / constant / wsd to min_lr."""

import math

import pytest

from minigpt.optim import OptimConfig, lr_multiplier, projected_decay_end


def test_warmup_is_linear_up_to_the_peak():
    cfg = OptimConfig(warmup_steps=10, lr_schedule="cosine")
    assert [lr_multiplier(s, cfg, 100) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]


@pytest.mark.parametrize("schedule,midpoint", [("cosine", 0.5), ("linear", 0.5), ("constant", 1.0)])
def test_decay_ends_at_min_lr(schedule, midpoint):
    cfg = OptimConfig(warmup_steps=10, lr_schedule=schedule, min_lr_ratio=0.1)
    assert lr_multiplier(10, cfg, 110) == pytest.approx(1.0)
    assert lr_multiplier(60, cfg, 110) == pytest.approx(0.1 + 0.9 * midpoint)
    assert lr_multiplier(110, cfg, 110) == pytest.approx(1.0 if schedule == "constant" else 0.1)
    assert lr_multiplier(500, cfg, 110) == pytest.approx(1.0 if schedule == "constant" else 0.1)


@pytest.mark.parametrize("fraction", [0.2, 0.4, 1.0])
def test_wsd_holds_the_peak_then_cools_down_over_its_fraction(fraction):
    """Decay from step 10 to 110: the peak is held until 110 - 100 * fraction, then falls linearly to min_lr."""
    cfg = OptimConfig(warmup_steps=10, lr_schedule="wsd", min_lr_ratio=0.0, cooldown_fraction=fraction)
    start = 110 - round(100 * fraction)
    for step in range(10, 111):
        expected = 1.0 if step <= start else (110 - step) / (110 - start)
        assert lr_multiplier(step, cfg, 110) == pytest.approx(expected), step


def test_no_known_end_holds_the_peak():
    cfg = OptimConfig(warmup_steps=10, lr_schedule="cosine")
    assert lr_multiplier(10_000, cfg, None) == 1.0


def test_time_budget_projects_the_end_from_the_speed_so_far():
    # 100 steps in 10 s with 30 s left: 400 steps by the end of the budget
    assert projected_decay_end(100, 10.0, 30.0) == 400
    assert math.isclose(projected_decay_end(50, 25.0, 0.0), 50)
