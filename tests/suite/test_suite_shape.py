"""The suite's own machinery: parallel units, their order, the budget, the caches."""

from __future__ import annotations

import json

from tests.helpers import run_cache
from tests.suite import budget, plan


def test_a_unit_is_a_module_a_shared_directory_or_a_shared_serve_layout():
    assert plan.unit_of("tests/router/test_policy.py::test_x[a-b]") == "tests/router/test_policy.py"
    assert plan.unit_of("tests/reliability/test_faults.py::t") == plan.unit_of("tests/reliability/test_overload.py::t")
    assert plan.unit_of("tests/chaos/test_reset_storm.py::t") == "tests/chaos"
    assert (plan.unit_of("tests/benchmark/test_compare.py::t") == plan.unit_of("tests/workers/test_cpu_pinning.py::t")
            != plan.unit_of("tests/benchmark/test_bench_cli.py::t"))


def test_units_go_longest_first_the_image_last_and_each_keeps_its_own_order():
    ids = ["tests/a.py::t1", "tests/image/test_image.py::i1", "tests/b.py::t1", "tests/a.py::t2",
           "tests/reliability/test_z.py::z1", "tests/reliability/test_y.py::y1", "tests/image/test_image.py::i2"]
    seconds = {"tests/a.py": 5.0, "tests/b.py": 50.0, "tests/image/test_image.py": 500.0,
               "tests/reliability/test_z.py": 10.0, "tests/reliability/test_y.py": 10.0}
    assert plan.order(ids, seconds) == [
        "tests/b.py::t1",  # 50 s
        "tests/reliability/test_z.py::z1", "tests/reliability/test_y.py::y1",  # 20 s together, file order kept
        "tests/a.py::t1", "tests/a.py::t2",  # 5 s
        "tests/image/test_image.py::i1", "tests/image/test_image.py::i2"]  # last whatever it costs
    assert plan.unit_seconds(["tests/new.py::t"], {}) == {"tests/new.py": plan.DEFAULT_SECONDS}


def test_each_xdist_worker_gets_its_share_of_the_cpus_for_torch():
    assert plan.torch_threads_per_worker(2, 2) == 1  # make test here: not two spinning threads per worker
    assert plan.torch_threads_per_worker(16, 2) == 8 and plan.torch_threads_per_worker(2, 3) == 1
    assert plan.torch_threads_per_worker(4, 0) == 4


def test_slow_modules_are_those_that_start_a_stack():
    assert plan.is_slow("tests/e2e/test_demo_serve.py::t") and plan.is_slow("tests/reliability/test_faults.py::t")
    assert not plan.is_slow("tests/engine/test_scheduler.py::t")
    assert not plan.is_slow("tests/security/test_api_keys.py::t")


def test_the_budget_names_every_module_over_its_own_limit_worst_first():
    seconds = {"tests/a.py": 121.0, "tests/b.py": 300.0, "tests/c.py": 119.0,
               "tests/e2e/test_model_families_serve.py": 390.0, "tests/image/test_image.py": 601.0}
    assert budget.over_budget(seconds) == [("tests/b.py", 300.0, 120.0), ("tests/a.py", 121.0, 120.0),
                                           ("tests/image/test_image.py", 601.0, 600.0)]
    assert all(reason for _, reason in budget.OWN_BUDGETS.values())  # every exception says why


def test_cache_keys_change_with_every_input_and_a_copy_shields_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_TEST_CACHE", str(tmp_path / "cache"))
    fields = {"seed": 3, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
              "intermediate_size": 96, "num_hidden_layers": 1}
    a = run_cache.cached_checkpoint(tmp_path / "a", "llama", fields)
    (a / "config.json").write_text("{}")  # a test scribbling on its copy
    b = run_cache.cached_checkpoint(tmp_path / "b", "llama", fields)
    assert json.loads((b / "config.json").read_text())["hidden_size"] == 64
    assert run_cache.model_digest(b) != run_cache.model_digest(a)
    run_cache.cached_checkpoint(tmp_path / "c", "llama", {**fields, "seed": 4})
    assert len(list((tmp_path / "cache" / "checkpoints").iterdir())) == 2  # one entry per distinct input

    calls = []
    value = run_cache.cached_json("refs", ("k", 1), lambda: calls.append(1) or [7, 8])
    again = run_cache.cached_json("refs", ("k", 1), lambda: calls.append(1) or [0])
    other = run_cache.cached_json("refs", ("k", 2), lambda: calls.append(1) or [9])
    assert (value, again, other, len(calls)) == ([7, 8], [7, 8], [9], 2)



def test_budgets_scale_with_a_slower_machine_and_never_shrink():
    seconds = {"tests/a.py": 200.0}
    assert budget.over_budget(seconds) == [("tests/a.py", 200.0, 120.0)]
    assert budget.over_budget(seconds, slowness=2.0) == []
    assert 1.0 <= budget.machine_slowness(repeats=1) < 50


def test_make_test_s_marker_expression_still_gets_the_whole_suite_budget():
    assert budget.is_whole_suite([], "", "not full")  # `make test`
    assert budget.is_whole_suite([], "", "")  # `make test-full`, plain pytest
    assert not budget.is_whole_suite([], "", "not slow and not full")  # `make test-fast`
    assert not budget.is_whole_suite(["tests/engine"], "", "not full")
    assert not budget.is_whole_suite([], "lora", "not full")


def test_a_serve_stopped_inside_a_test_with_its_pools_held_fails_that_test(tmp_path, monkeypatch):
    """SplitserveProcess.stop checks a live serve's pools before its Ctrl-C; what is held is
    reported to the autouse check (tests/helpers/pools.py), which fails the test."""
    import subprocess
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from tests.helpers.pools import pools_back_to_idle
    from tests.helpers.processes import SplitserveProcess

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # a pool with one block still held
            body = b'{"kv": {"free_blocks": 7, "total_blocks": 8, "sequences": 1}, "streams": 0}'
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(SplitserveProcess, "idle_timeout_s", 0.3)
    serve = object.__new__(SplitserveProcess)  # a stand-in child with a real worker line in its log
    serve.port, serve.proc = 1, subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                                 start_new_session=True)
    serve.lines = [f"splitserve: decode worker decode-0: gRPC 127.0.0.1:1, KV receiver 127.0.0.1:2, "
                   f"metrics http://127.0.0.1:{server.server_port}/metrics\n"]
    try:
        checks = pools_back_to_idle.__wrapped__()
        next(checks)
        SplitserveProcess.serving.add(serve)
        serve.stop()
        assert serve.proc.poll() is not None  # stopped all the same
        try:
            next(checks)
        except AssertionError as exc:
            assert "decode-0" in str(exc) and "'free_blocks': 7" in str(exc), exc
        else:
            raise AssertionError("a serve stopped with a held block passed the idle check")
        serve.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        SplitserveProcess.serving.add(serve)
        serve.stop(check_idle=False)  # a test stopping it mid-flight on purpose
        assert SplitserveProcess.held_at_stop == []
    finally:
        server.shutdown()
        SplitserveProcess.serving.discard(serve)
        if serve.proc.poll() is None:
            serve.proc.kill()
