"""How many torch threads a worker takes: the CPUs it may use (affinity, capped by the
container's cgroup quota), and `splitserve serve`'s equal split among its workers."""

import argparse

import pytest

from splitserve.core.cpus import available_cpus, parse_cpu_max, threads_per_worker
from splitserve.serve import build_parser, main, worker_threads


@pytest.mark.parametrize(("text", "cpus"), [("max 100000\n", None), ("200000 100000\n", 2.0),
                                            ("150000 100000", 1.5), ("50000 100000", 0.5), ("", None),
                                            ("garbage", None), ("0 100000", None), ("100 0", None)])
def test_cgroup_cpu_max(text, cpus):
    assert parse_cpu_max(text) == cpus


@pytest.mark.parametrize(("affinity", "cpu_max", "expected"), [
    (64, "400000 100000", 4),  # a pod limited to 4 CPUs on a 64-core node: 4, not 64
    (64, "150000 100000", 2),  # 1.5 CPUs: rounded up (one thread idles half the time, none starve)
    (2, "800000 100000", 2),  # the affinity set is smaller than the quota
    (8, "max 100000", 8), (8, "", 8),  # unlimited, or no cgroup v2
    (4, "10000 100000", 1),  # a tenth of a CPU: still one thread
])
def test_available_cpus(affinity, cpu_max, expected):
    assert available_cpus(affinity, cpu_max) == expected


def test_available_cpus_of_this_process_is_positive():
    assert available_cpus() >= 1


# one CPU is left to the serving threads once there are two: 2 CPUs, one worker -> 1 thread
@pytest.mark.parametrize(("cpus", "workers", "threads"), [(2, 2, 1), (2, 1, 1), (16, 3, 5), (16, 1, 15), (2, 5, 1),
                                                         (1, 1, 1), (4, 1, 3), (8, 2, 3)])
def test_threads_per_worker(cpus, workers, threads):
    assert threads_per_worker(cpus, workers) == threads


def test_more_cpus_than_the_process_may_use_is_said(caplog):
    args = build_parser().parse_args(["--cpus", str(available_cpus() + 6), "--decode-workers", "2",
                                      "--prefill-workers", "0"])
    assert worker_threads(args) == (available_cpus() + 6 - 1) // 2
    assert "more than the" in caplog.text and "outnumber the cores" in caplog.text


def test_serve_splits_cpus_among_its_workers_unless_told():
    parse = build_parser().parse_args
    assert worker_threads(parse(["--cpus", "9", "--prefill-workers", "1", "--decode-workers", "3"])) == 2
    assert worker_threads(parse(["--cpus", "8", "--torch-threads", "3"])) == 3
    default = parse([])
    assert (default.prefill_workers, default.decode_workers) == (1, 1)
    assert worker_threads(default) == max(1, (available_cpus() - 1) // 2)
    assert isinstance(default, argparse.Namespace)


@pytest.mark.parametrize("flag", ["--cpus", "--torch-threads", "--stream-interval"])
def test_serve_refuses_zero(flag, capsys):
    try:
        code = main([flag, "0"])
    except SystemExit as exc:  # argparse's own refusal (a type check)
        code = exc.code
    assert code == 2
    assert flag in capsys.readouterr().err
