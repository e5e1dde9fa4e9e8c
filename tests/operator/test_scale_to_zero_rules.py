"""Scale to zero in the autoscaler's pure decision (autoscaler.py + scale_to_zero.py) and
in the rendered router: held requests scale decode up from zero at once, the last
replica goes only after the idle window with nothing waiting or running, and a role
without minReplicas 0 never reaches zero."""

from __future__ import annotations

from dataclasses import replace

from splitserve.cluster.messages import LoadReport
from splitserve.operator.autoscaler import ScalingPolicy, Windows, decide
from splitserve.operator.render import Replicas, render_all
from splitserve.operator.spec import parse_spec

ZERO = ScalingPolicy(min_replicas=0, max_replicas=4, target=4.0, low_watermark=0.5, up_window_s=30,
                     down_window_s=60, max_step=2, stale_after_s=30, scale_to_zero_after_s=300)


def load(worker: str, waiting: int, running: int, t: float) -> LoadReport:
    return LoadReport(worker_id=worker, role="decode", waiting=waiting, running=running, kv_usage=0.0, timestamp=t)


def test_held_requests_scale_up_from_zero_at_once():
    held = [load("router-held-abc", 3, 0, 1000.0)]
    d = decide(ZERO, 0, held, 1000.0, Windows())
    assert (d.replicas, d.reason, d.waiting) == (1, "3 requests held at zero: scale up 0 -> 1", 3)
    d = decide(ZERO, 0, [load("router-held-abc", 30, 0, 1000.0)], 1000.0, Windows())
    assert d.replicas == 2  # ceil(30 / 4) = 8, but at most maxStep per step


def test_zero_stays_zero_without_held_requests():
    assert decide(ZERO, 0, [], 1000.0, Windows()).replicas == 0  # no reports at all
    d = decide(ZERO, 0, [load("router-held-abc", 0, 0, 1000.0)], 1000.0, Windows())
    assert (d.replicas, d.reason) == (0, "scaled to zero, no request held: holding at 0")


def run_idle(policy: ScalingPolicy, running: int, ticks: int) -> list[int]:
    replicas, windows, history = 1, Windows(), []
    for i in range(ticks):
        now = 1000.0 + 10 * i
        d = decide(policy, replicas, [load("decode-0", 0, running, now)] if replicas else [], now, windows)
        replicas, windows = d.replicas, d.windows
        history.append(replicas)
    return history


def test_idle_decode_goes_to_zero_after_the_idle_window_only():
    history = run_idle(ZERO, running=0, ticks=40)
    # below target from t=0: the down window (60 s) passes, then the idle window (300 s)
    assert history.index(0) == 30 and history[30:] == [0] * 10 and set(history[:30]) == {1}


def test_a_running_stream_keeps_the_last_replica():
    assert run_idle(ZERO, running=1, ticks=60) == [1] * 60
    d = decide(ZERO, 1, [load("decode-0", 0, 1, 2000.0)], 2000.0, Windows(below_since=1000.0))
    assert d.reason.endswith("1 requests waiting or running: keeping 1 (scale to zero needs idle)")


def test_min_replicas_one_never_reaches_zero():
    assert run_idle(replace(ZERO, min_replicas=1), running=0, ticks=60) == [1] * 60


def test_router_holds_only_when_decode_may_scale_to_zero(minimal_spec):
    def router_args(spec: dict) -> list[str]:
        parsed = parse_spec("llama", "ns", spec, "img:1")
        (router,) = [m for m in render_all(parsed, Replicas(1, 1), "2.60.0")
                     if m["metadata"]["name"] == "llama-router" and m["kind"] == "Deployment"]
        return router["spec"]["template"]["spec"]["containers"][0]["args"]

    assert "--hold-requests-at-zero" not in router_args(minimal_spec)
    args = router_args({**minimal_spec, "decode": {"minReplicas": 0},
                        "autoscaling": {"holdRequestsAtZero": 8, "holdTimeoutSeconds": 90}})
    assert args[args.index("--hold-requests-at-zero"):][:4] == ["--hold-requests-at-zero", "8", "--hold-timeout", "90"]
