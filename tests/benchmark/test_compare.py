"""`splitserve bench compare` against a real `splitserve serve` under two names: every round
sends the same prompts to each server, in a rotating order, and reports medians and ratios."""

from __future__ import annotations

import json

from splitserve.benchmark import compare


def test_run_order_rotates_by_round():
    a, b, c = (compare.Server(n, "u", "m") for n in "abc")
    assert [[s.name for s in compare.run_order([a, b, c], r)] for r in range(4)] == \
        [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_summary_is_the_median_of_rounds_and_the_ratio_to_the_first():
    servers = [compare.Server("x", "u", "m"), compare.Server("y", "u", "m")]
    runs = [{"round": r, "concurrency": 8, "server": s, "output_tok_s": v, "ttft_ms": 10.0 * r,
             "ttft_p50_ms": 5.0 * r, "itl_ms": 1.0, "failed": 0}
            for r, (s, v) in enumerate([("x", 100.0), ("y", 50.0), ("x", 120.0), ("y", 90.0), ("x", 80.0),
                                        ("y", 60.0)])]
    rows = compare.summarize(runs, servers)
    assert [(r["server"], r["output_tok_s"], r["tok_s_ratio_to_first"], r["ttft_ms"], r["ttft_p50_ms"])
            for r in rows] == [("x", 100.0, 1.0, 20.0, 10.0), ("y", 60.0, 0.6, 30.0, 15.0)]


def test_a_round_where_every_request_failed_is_reported_not_a_crash():
    """All of a round's requests failed (the server dropped out): no latencies for that round,
    the line says FAILED, the summary takes the other rounds' medians and counts the failures."""
    servers = [compare.Server("x", "u", "m"), compare.Server("y", "u", "m")]
    dead = {"output_tok_s": 0.0, "ttft_ms": None, "ttft_p50_ms": None, "itl_ms": None, "failed": 128}
    ok = {"output_tok_s": 90.0, "ttft_ms": 30.0, "ttft_p50_ms": 25.0, "itl_ms": 2.0, "failed": 0}
    assert compare.describe_run("x", dead) == "x: 0 tok/s, TTFT - ms (p50 -), 128 FAILED"
    assert compare.describe_run("y", ok) == "y: 90 tok/s, TTFT 30 ms (p50 25)"
    runs = [{"round": r, "concurrency": 8, "server": s, **(dead if (r, s) == (0, "x") else ok)}
            for r in range(3) for s in "xy"]
    x, y = compare.summarize(runs, servers)
    assert (x["ttft_ms"], x["ttft_p50_ms"], x["failed"], x["output_tok_s"]) == (30.0, 25.0, 128, 90.0)
    assert y["failed"] == 0


def test_compare_exits_1_when_a_server_failed_requests(monkeypatch, tmp_path, capsys):
    results = iter([{"output_tok_s": 50.0, "ttft_ms": None, "ttft_p50_ms": None, "itl_ms": None, "failed": 2,
                     "ttft_by_request_ms": [None, None]},
                    {"output_tok_s": 90.0, "ttft_ms": 30.0, "ttft_p50_ms": 25.0, "itl_ms": 2.0, "failed": 0,
                     "ttft_by_request_ms": [30.0, 30.0]}])
    monkeypatch.setattr(compare, "measure", lambda *a: next(results))
    assert compare.main(["--server", "a,u,m", "--server", "b,u,m", "--concurrency", "1", "--rounds", "1",
                         "--json", str(tmp_path / "c.json")]) == 1
    assert "requests failed ({'a': 2} over all rounds)" in capsys.readouterr().err
    assert json.loads((tmp_path / "c.json").read_text())["summary"][0]["failed"] == 2


def test_common_ttft_covers_only_requests_every_server_streamed_text_for():
    """Request 1 never streamed text at server b (its bytes never formed a character: b drops
    them) and only at its end at server a (a flushed them): it stays out of both common means."""
    a = {"ttft_by_request_ms": [10.0, 1500.0, 30.0]}
    b = {"ttft_by_request_ms": [20.0, None, 40.0]}
    compare.add_common_ttft([a, b])
    assert (a["ttft_common_ms"], a["ttft_common_p50_ms"], a["ttft_common_requests"]) == (20.0, 20.0, 2)
    assert (b["ttft_common_ms"], b["ttft_common_p50_ms"]) == (30.0, 30.0)
    c = {"ttft_by_request_ms": [None, None, None]}
    compare.add_common_ttft([a, c])
    assert a["ttft_common_ms"] is None and a["ttft_common_requests"] == 0


def test_pause_is_quiet_before_every_measurement(monkeypatch, tmp_path):
    events = []
    monkeypatch.setattr(compare.time, "sleep", lambda s: events.append(("sleep", s)))
    monkeypatch.setattr(compare, "measure", lambda server, *a: events.append(("measure", server.name)) or
                        {"output_tok_s": 1.0, "ttft_ms": 1.0, "ttft_p50_ms": 1.0, "itl_ms": 1.0, "failed": 0,
                         "ttft_by_request_ms": [1.0]})
    assert compare.main(["--server", "a,u,m", "--server", "b,u,m", "--concurrency", "1", "--rounds", "2",
                         "--pause", "7.5"]) == 0
    assert events == [("sleep", 7.5), ("measure", "a"), ("sleep", 7.5), ("measure", "b"),
                      ("sleep", 7.5), ("measure", "b"), ("sleep", 7.5), ("measure", "a")]


def test_compare_runs_interleaved_against_real_servers(shared_serve, tmp_path):
    serve = shared_serve("llama-0p1d")  # tests/helpers/shared_serve.py: served as "m"
    out = tmp_path / "compare.json"
    url = serve.base_url
    assert compare.main(["--server", f"first,{url},m", "--server", f"second,{url},m", "--concurrency", "1,4",
                         "--rounds", "2", "--requests", "4", "--input-len", "8:16", "--output-len", "4:6",
                         "--note", "one server under two names", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["round"], r["concurrency"], r["server"]) for r in doc["runs"]] == [
        (0, 1, "first"), (0, 1, "second"), (0, 4, "first"), (0, 4, "second"),
        (1, 1, "second"), (1, 1, "first"), (1, 4, "second"), (1, 4, "first")]
    assert all(r["failed"] == 0 and r["output_tok_s"] > 0 and 0 < r["ttft_p50_ms"] for r in doc["runs"])
    assert [r["tok_s_ratio_to_first"] for r in doc["summary"] if r["server"] == "first"] == [1.0, 1.0]
    assert doc["note"] == "one server under two names"


def test_each_run_draws_its_own_prompts_unless_given_a_seed(monkeypatch, tmp_path):
    """Two compares against servers still up must not send the same prompts (the second would
    be answered from the first one's prefix caches: measured, vLLM's TTFT p50 fell from 72 to
    32 ms); --seed repeats a run."""
    seen: list[int] = []
    monkeypatch.setattr(compare, "measure", lambda server, workload, c: seen.append(workload.seed) or {
        "output_tok_s": 1.0, "ttft_ms": 1.0, "ttft_p50_ms": 1.0, "itl_ms": 1.0, "failed": 0,
        "ttft_by_request_ms": [1.0]})
    argv = ["--server", "a,http://x,m", "--server", "b,http://y,m", "--concurrency", "1,8,32", "--rounds", "3"]
    runs = []
    for extra in ([], [], ["--seed", "5"], ["--seed", "5"]):
        seen.clear()
        assert compare.main([*argv, *extra, "--json", str(tmp_path / "c.json")]) == 0
        runs.append((set(seen), json.loads((tmp_path / "c.json").read_text())["seed"]))
        assert len(set(seen)) == 9 and len(seen) == 18  # 3 rounds x 3 concurrencies, both servers alike
    assert not runs[0][0] & runs[1][0] and runs[0][1] != runs[1][1]
    assert runs[2] == runs[3] and runs[2][1] == 5
