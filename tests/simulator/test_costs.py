"""Cost-model fitting on synthetic measurements with known answers, and profile loading."""

import json

import numpy as np
import pytest

from splitserve.simulator.costs import (
    AffineCost,
    CostModel,
    ServingOverhead,
    StepCost,
    attention_work,
    fit_nonnegative,
    load_costs,
)

TRUE = StepCost(c_step=2e-3, c_token=3e-4, c_seq=5e-5, c_attn=2e-8, c_ctx=6e-8)


def synthetic_rows(cost: StepCost) -> list[dict]:
    rows = []
    for new, cached in [(16, 0), (256, 0), (1024, 0), (2048, 0), (32, 1024), (256, 512)]:
        rows.append({"new_tokens": new, "sequences": 1, "attention": attention_work(new, cached),
                     "seconds": cost.prefill(new, cached)})
    for batch in (1, 4, 16, 64):
        for ctx in (64, 1024):
            rows.append({"new_tokens": batch, "sequences": batch, "attention": 0.0,
                         "decode_context": batch * (ctx + 1), "seconds": cost.decode(batch, batch * ctx)})
    return rows


def test_step_fit_recovers_exact_coefficients():
    fitted = StepCost.fit(synthetic_rows(TRUE))
    for name in ("c_step", "c_token", "c_seq", "c_attn", "c_ctx"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-6)


def test_step_fit_is_robust_to_relative_noise():
    rng = np.random.default_rng(0)
    rows = synthetic_rows(TRUE)
    for r in rows:
        r["seconds"] *= 1 + rng.uniform(-0.03, 0.03)
    fitted = StepCost.fit(rows)
    errors = [abs(fitted.time(r["new_tokens"], r["sequences"], r["attention"], r.get("decode_context", 0.0))
                  / r["seconds"] - 1) for r in rows]
    assert max(errors) < 0.08


def test_negative_coefficient_is_dropped_and_the_rest_refitted():
    # y = 2 + 3x exactly; a third feature anti-correlated with nothing useful would come out
    # negative in plain least squares when y has a dip. Here: force it with y = 5 - z.
    x = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    y = np.array([5.0, 4.0, 3.0, 2.0])
    coef = fit_nonnegative(x, y, relative=False)
    assert coef[1] == 0.0  # the slope would be -1: dropped
    assert coef[0] == pytest.approx(3.5)  # the mean of y, the best constant


def test_fit_rejects_too_few_rows_and_non_positive_times():
    with pytest.raises(ValueError, match="at least 2 measurements"):
        fit_nonnegative(np.array([[1.0, 2.0]]), np.array([1.0]))
    with pytest.raises(ValueError, match="positive"):
        fit_nonnegative(np.array([[1.0], [1.0]]), np.array([1.0, 0.0]))


def test_affine_transfer_fit():
    sizes = [32768 * n for n in (1, 4, 16, 64, 256)]
    fitted = AffineCost.fit(sizes, [1e-3 + s * 2e-10 for s in sizes])
    assert fitted.fixed == pytest.approx(1e-3)
    assert fitted.per_unit == pytest.approx(2e-10)


def test_cost_model_round_trip_and_load(tmp_path):
    costs = CostModel(step=TRUE, transfer=AffineCost(1e-3, 2e-10), routing_s=5e-5,
                      serving=ServingOverhead(4e-3, 1e-3), kv_bytes_per_token=2048)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"costs": costs.to_dict()}))
    assert load_costs(path) == costs


def test_load_costs_errors_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="cannot read profile .*splitserve profile"):
        load_costs(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_costs(bad)
    bad.write_text(json.dumps({"samples": {}}))
    with pytest.raises(ValueError, match="no 'costs' section"):
        load_costs(bad)
    bad.write_text(json.dumps({"costs": {"step": {}}}))
    with pytest.raises(ValueError, match="missing or has a malformed field"):
        load_costs(bad)
