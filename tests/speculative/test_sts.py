"""Sequential temperature scaling (deepinfer_dspark.calibrate) on synthetic logs: the
fit recovers the temperature that made a head over-confident, position by position, and lowers the
cumulative ECE; the logits are recovered exactly from the engine's cumulative confidences."""
from __future__ import annotations

import json

import numpy as np
import pytest
from deepinfer_dspark.calibrate import (
    cumulative_ece,
    ece,
    fit_temperatures,
    load_prompts,
    position_logits,
)


def synthetic_log(temps_true: list[float], n: int = 20000, seed: int = 0) -> tuple[list, np.ndarray]:
    """Records as the engine logs them at T = 1, from a head whose logit is the true acceptance logit
    times temps_true[k] (over-confident when > 1)."""
    rng = np.random.default_rng(seed)
    gamma = len(temps_true)
    true = rng.normal(0.5, 1.5, (n, gamma))
    accept = rng.random((n, gamma)) < 1 / (1 + np.exp(-true))
    accepted = np.where(accept.all(1), gamma, np.argmin(accept, 1))
    head = 1 / (1 + np.exp(-true * np.asarray(temps_true)))
    records = [(np.cumprod(h).astype(np.float32).tolist(), int(j)) for h, j in zip(head, accepted)]
    return records, true


def test_the_fit_recovers_each_positions_temperature_and_lowers_the_ece():
    temps_true = [2.0, 1.0, 0.5]
    records, _ = synthetic_log(temps_true)
    z, accepted = position_logits(records, 3)
    temps = fit_temperatures(z, accepted)
    assert temps == pytest.approx(temps_true, rel=0.15)
    before, after = cumulative_ece(z, accepted, [1.0] * 3), cumulative_ece(z, accepted, temps)
    assert before[0] > 0.05 and all(a < 0.02 for a in after)


def test_position_logits_invert_the_cumulative_confidences():
    records, true = synthetic_log([1.0, 1.0], n=50)
    z, accepted = position_logits(records, 2)
    assert np.allclose(z, true, atol=1e-3)                      # float32 products: close, not exact
    short = position_logits([([0.5], 0), ([0.5, 0.25], 2)], 2)[0]
    assert np.isnan(short[0, 1]) and short[1, 1] == pytest.approx(0.0)  # 0.25 / 0.5: logit 0


def test_ece_of_a_perfect_and_of_a_wrong_predictor():
    label = np.array([1.0, 0.0] * 50)
    assert ece(np.full(100, 0.5), label) == 0.0
    assert ece(np.ones(100), label) == pytest.approx(0.5)


def test_prompt_files_are_checked(tmp_path):
    good = tmp_path / "p.json"
    good.write_text(json.dumps({"prompts": ["a", "b"]}))
    assert load_prompts(good) == ["a", "b"]
    bad = tmp_path / "q.json"
    bad.write_text(json.dumps(["only one"]))
    with pytest.raises(ValueError, match="--prompts .*at least 2 prompt strings"):
        load_prompts(bad)
