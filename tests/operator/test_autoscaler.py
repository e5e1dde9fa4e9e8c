"""The autoscaler's pure decision function, driven tick by tick over load traces."""

from __future__ import annotations

from splitserve.cluster.messages import LoadReport
from splitserve.operator.autoscaler import ScalingPolicy, Windows, decide

TICK = 10.0
POLICY = ScalingPolicy(min_replicas=1, max_replicas=8, target=4.0, low_watermark=0.5, up_window_s=30,
                       down_window_s=60, max_step=2, stale_after_s=30)


def reports(role: str, waiting_per_worker: list[int], t: float) -> list[LoadReport]:
    return [LoadReport(worker_id=f"{role}-{i}", role=role, waiting=w, running=1, kv_usage=0.3, timestamp=t)
            for i, w in enumerate(waiting_per_worker)]


def run(trace, replicas: int, policy: ScalingPolicy = POLICY, role: str = "decode"):
    """trace: per tick, the total waiting (spread over the current replicas), or None
    for no reports at all. Returns the replicas after every tick and the decisions."""
    windows, history, decisions = Windows(), [], []
    for i, total in enumerate(trace):
        now = 1000.0 + i * TICK
        if total is None:
            rs = []
        else:
            per, extra = divmod(total, replicas)
            rs = reports(role, [per + (1 if j < extra else 0) for j in range(replicas)], now)
        d = decide(policy, replicas, rs, now, windows)
        replicas, windows = d.replicas, d.windows
        history.append(replicas)
        decisions.append(d)
    return history, decisions


def test_steady_load_at_target_never_scales():
    history, decisions = run([8] * 60, replicas=2)  # 4 per replica == target
    assert history == [2] * 60
    assert "within band" in decisions[-1].reason and decisions[-1].waiting == 8


def test_burst_scales_up_after_the_up_window_in_bounded_steps():
    # 2 replicas, then 40 waiting (20/replica, target 4): needs ceil(40/4) = 10 > max 8.
    history, decisions = run([8] * 3 + [40] * 20, replicas=2)
    assert history[:6] == [2, 2, 2, 2, 2, 2]  # above target at ticks 3,4,5: window 30s not yet full
    assert history[6] == 4  # +maxStep after 30s above target
    first_up = 6
    # each step restarts the window (cooldown): next step no sooner than 30s later
    assert history[first_up + 1:first_up + 4] == [4, 4, 4]
    assert history[first_up + 4] == 6
    assert max(history) == 8 and history[-1] == 8  # capped at maxReplicas
    assert "at maxReplicas 8" in decisions[-1].reason
    steps = [b - a for a, b in zip(history, history[1:], strict=False) if b != a]
    assert all(0 < s <= POLICY.max_step for s in steps)


def test_scale_up_jumps_only_to_what_the_queue_needs():
    # 18 waiting over 4 replicas (4.5 > 4): needs ceil(18/4) = 5, one step, not maxStep.
    history, _ = run([18] * 5, replicas=4)
    assert history[3] == 5 and history[-1] == 5


def test_drop_to_zero_scales_down_to_min_after_down_window():
    history, decisions = run([0] * 30, replicas=6)
    assert history[:6] == [6] * 6  # below low watermark, but the down window is 60s
    assert history[6] == 4  # -maxStep
    assert history[-1] == 1  # min_replicas
    steps = [a - b for a, b in zip(history, history[1:], strict=False) if b != a]
    assert all(0 < s <= POLICY.max_step for s in steps)
    assert "scale down" in decisions[6].reason


def test_scale_down_keeps_enough_capacity_for_the_remaining_queue():
    # 10 waiting over 8 replicas = 1.25 < 2 (low watermark): down by maxStep until
    # the load is back in the band (10/4 = 2.5), then hold.
    history, _ = run([10] * 40, replicas=8)
    assert sorted(set(history)) == [4, 6, 8] and history[-1] == 4
    # With a large maxStep the step stops at ceil(10/4) = 3, so a scale-down cannot
    # by itself push the load back above target.
    big_steps = ScalingPolicy(1, 8, 4.0, 0.5, 30, 60, 8, 30)
    history, _ = run([10] * 40, replicas=8, policy=big_steps)
    assert sorted(set(history)) == [3, 8] and history[-1] == 3


def test_missing_data_holds_and_never_scales_down():
    history, decisions = run([None] * 30, replicas=5)
    assert history == [5] * 30
    assert decisions[-1].reason == "no load reports on the cluster bus: holding at 5"
    assert decisions[-1].waiting is None


def test_gap_in_data_restarts_the_windows():
    # Above target 20s, a missing sample, above target again: the up window (30s)
    # must be observed without a gap before scaling.
    history, _ = run([40, 40, 40, None, 40, 40, 40, 40], replicas=2)
    assert history[:7] == [2] * 7 and history[7] == 4


def test_stale_reports_count_as_missing():
    now = 5000.0
    old = reports("decode", [0, 0], now - 120)  # a crashed bus writer left old zeros behind
    windows = Windows()
    for i in range(20):
        d = decide(POLICY, 4, old, now + i * TICK, windows)
        windows = d.windows
        assert d.replicas == 4
    assert d.reason.startswith("stale load reports (newest")


def test_only_fresh_reports_are_counted_newest_per_worker():
    now = 100.0
    rs = [LoadReport("decode-0", "decode", 100, 1, 0.9, timestamp=now - 5),   # superseded
          LoadReport("decode-0", "decode", 2, 1, 0.5, timestamp=now - 1),
          LoadReport("decode-1", "decode", 50, 1, 0.5, timestamp=now - 300)]  # stale
    d = decide(POLICY, 1, rs, now, Windows())
    assert d.waiting == 2


def test_flapping_around_target_does_not_oscillate():
    # Load alternating just above and just below target every tick, for 10 minutes.
    trace = [9 if i % 2 == 0 else 7 for i in range(60)]  # 4.5 / 3.5 per replica over 2
    history, _ = run(trace, replicas=2)
    assert history == [2] * 60
    # Hovering slightly above target with short dips below also never flaps down.
    trace = [9, 9, 7] * 20
    history, _ = run(trace, replicas=2)
    assert history == [2] * 60


def test_bounds_are_enforced_even_without_data():
    # min/max changed by the user: replicas are brought into bounds at once.
    tight = ScalingPolicy(3, 5, 4.0, 0.5, 30, 60, 2, 30)
    d = decide(tight, 8, [], 0.0, Windows())
    assert d.replicas == 5 and "outside [3, 5]" in d.reason
    d = decide(tight, 1, [], 0.0, Windows())
    assert d.replicas == 3


def test_prefill_and_decode_decide_independently():
    now = 1000.0
    windows = {"prefill": Windows(), "decode": Windows()}
    replicas = {"prefill": 2, "decode": 2}
    zero_window = ScalingPolicy(1, 8, 4.0, 0.5, 0, 0, 2, 30)
    # Prefill is swamped, decode idle: prefill goes up while decode goes down.
    bus = reports("prefill", [30, 30], now) + reports("decode", [0, 0], now)
    for role in ("prefill", "decode"):
        d = decide(zero_window, replicas[role], [r for r in bus if r.role == role], now, windows[role])
        replicas[role], windows[role] = d.replicas, d.windows
    assert replicas == {"prefill": 4, "decode": 1}


def test_zero_windows_scale_on_the_first_sample():
    policy = ScalingPolicy(1, 8, 2.0, 0.5, 0, 0, 3, 30)
    d = decide(policy, 1, reports("decode", [10, 10], 0.0), 0.0, Windows())
    assert d.replicas == 4 and d.reason.endswith("scale up 1 -> 4")
