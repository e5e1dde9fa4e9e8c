"""The serving banner is found wherever it lands in mixed output (CI's flake of the qwen3 serve test)."""

from __future__ import annotations

from splitserve.core.banner import serving_banner, serving_url

# Exactly what CI captured: Ray's forwarded log line, then `serve`'s banner before Ray's newline.
MASHED = ("(WorkerActor pid=3743) 2026-11-26 17:32:27,611 INFO splitserve.kvtransfer.receiver: KV receiver of "
          "worker decode-0 listening on 127.0.0.1:36287 (backend grpc)splitserve: serving 'family-under-test' on "
          "http://127.0.0.1:34277/v1 (1 prefill + 1 decode workers, 1 torch thread(s) each, bus: in-process, "
          "KV transfer: grpc)\n")


def test_a_banner_after_a_forwarded_worker_log_on_the_same_line_is_found():
    assert serving_url(MASHED) == "http://127.0.0.1:34277"


def test_both_programs_banners_round_trip_with_any_served_name():
    for program in ("splitserve", "splitserve router"):
        for name in ("demo", "it's/a model", 'with "quotes"'):
            line = serving_banner(program, name, "0.0.0.0", 8000, "details") + "(WorkerActor pid=1) trailing\n"
            assert serving_url(line) == "http://0.0.0.0:8000"


def test_lines_that_only_mention_serving_are_not_the_banner():
    for line in ("2026-11-26 INFO splitserve.serve: no --model given: serving the demo model\n",
                 "splitserve: decode worker decode-0: gRPC 127.0.0.1:1, metrics http://127.0.0.1:2/metrics\n",
                 "splitserve: serving 'x' on grpc://127.0.0.1:3\n",
                 "prefill worker prefill-0 serving on 127.0.0.1:38063 (admin http://127.0.0.1:35883; links)\n"):
        assert serving_url(line) is None
