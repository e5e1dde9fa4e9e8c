"""`splitserve bench` end to end against the scripted fake server: the JSON result
schema, the plots, the exit codes and the argument errors."""

from __future__ import annotations

import json
import re

import jsonschema
import matplotlib.image
import pytest

from splitserve import cli
from splitserve.benchmark.client import error_message
from splitserve.benchmark.results import RESULT_SCHEMA
from splitserve.benchmark.serving import main
from tests.benchmark.bench_fake_server import TEMPLATE_TOKENS, Script

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def flaky_server(body, i):
    if i == 3:
        return Script(status=503, error_body={"error": {"message": "no decode worker ready"}})
    return Script(first_delay=0.01, gap=0.005, texts=["x"] * 3, completion_tokens=3)


def test_sweep_writes_schema_valid_json_and_plots(fake_server, tmp_path, capsys):
    server = fake_server(flaky_server)
    result_file, plot_dir = tmp_path / "out" / "result.json", tmp_path / "plots"
    rc = main(["--base-url", server.base_url, "--model", "fake-model", "--api-key", "sk-secret",
               "--num-prompts", "8", "--input-len", "4:8", "--output-len", "3",
               "--sweep-rates", "50,inf", "--goodput", "ttft:2000", "tpot:2000",
               "--percentiles", "50,90,99", "--result-file", str(result_file),
               "--plot-dir", str(plot_dir), "--save-requests", "--no-progress", "--label", "t"])
    assert rc == 0
    doc = json.loads(result_file.read_text())
    jsonschema.validate(doc, RESULT_SCHEMA)
    assert "sk-secret" not in result_file.read_text()  # the API key never lands in results
    assert doc["config"]["request_rates"] == [50.0, "inf"]
    assert doc["config"]["workload"]["kind"] == "random"
    first, second = doc["runs"]
    assert [first["request_rate"], second["request_rate"]] == [50.0, "inf"]
    assert (first["completed"], first["failed"]) == (7, 1)
    (error,) = first["errors"]
    assert (error["status"], error["message"], error["count"]) == (503, "no decode worker ready", 1)
    # the example names the request the server failed (the 4th to arrive: Poisson arrivals
    # may reach the server out of the client's numbering)
    assert re.fullmatch(r"bench-[0-9a-f]{6}-req-[0-7]", error["example_request_id"])
    assert error["example_request_id"] == server.requests[3]["headers"]["X-Request-Id"]
    assert (second["completed"], second["failed"]) == (8, 0)
    assert first["total_output_tokens"] == 21 and first["output_token_source"] == "usage"
    assert first["total_input_tokens"] == 7 * 7  # the fake server reports 7 prompt tokens
    assert set(first["ttft_ms"]) == {"mean", "median", "std", "p50", "p90", "p99"}
    assert first["request_goodput"] is not None and len(first["requests"]) == 8
    ok = [r for r in first["requests"] if r["success"]]
    assert all(len(r["itl_ms"]) == 2 and r["ttft_ms"] >= 10.0 for r in ok)
    # each rate of a sweep gets fresh prompts, so no run is served from the last one's cache
    prompts = [tuple(req["body"]["prompt"]) for req in server.requests]
    assert not set(prompts[:8]) & set(prompts[8:])
    for name in ("ttft_cdf.png", "latency_vs_rate.png"):
        data = (plot_dir / name).read_bytes()
        assert data.startswith(PNG_MAGIC)
        height, width, _ = matplotlib.image.imread(plot_dir / name).shape
        assert height > 300 and width > 500
    out = capsys.readouterr().out
    assert "Mean TTFT (ms):" in out and "P99 ITL (ms):" in out and "Request goodput" in out
    assert f"1 x [503] no decode worker ready (e.g. {error['example_request_id']})" in out
    table = out[out.index("Sweep summary"):].splitlines()
    assert "TTFT p99" in table[1]
    assert table[2].split()[:3] == ["50", "7", "1"] and table[3].split()[:3] == ["inf", "8", "0"]


def test_single_run_through_the_cli_dispatch(fake_server, tmp_path):
    server = fake_server(lambda body, i: Script(texts=["a", "b"]))
    rc = cli.main(["bench", "--base-url", server.base_url, "--model", "m", "--no-progress",
                   "--endpoint", "/v1/chat/completions", "--workload", "prefix-repetition",
                   "--num-prefixes", "2", "--suffixes-per-prefix", "3", "--prefix-len", "8",
                   "--input-len", "2", "--request-rate", "100", "--arrival", "constant",
                   "--plot-dir", str(tmp_path)])
    assert rc == 0
    assert len(server.requests) == 6
    contents = [r["body"]["messages"][0]["content"] for r in server.requests]
    # sized by the server's /tokenize, chat template included: 8 + 2 tokens, 5 of them the template's
    assert all(len(c.split()) + TEMPLATE_TOKENS == 10 for c in contents)
    assert len({" ".join(c.split()[:3]) for c in contents}) == 2  # two shared prefixes of 3 words
    assert server.tokenize_requests and all(list(b) == ["model", "messages", "add_generation_prompt"]
                                            for b in server.tokenize_requests)
    assert (tmp_path / "ttft_cdf.png").read_bytes().startswith(PNG_MAGIC)
    assert not (tmp_path / "latency_vs_rate.png").exists()  # only a sweep plots against rate


def test_all_requests_failing_exits_1_with_a_hint(fake_server, capsys):
    server = fake_server(lambda body, i: Script(status=404, error_body={
        "object": "error", "message": "The model `nope` does not exist."}))
    rc = main(["--base-url", server.base_url, "--model", "nope", "--num-prompts", "2",
               "--no-progress"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "every request failed [404] The model `nope` does not exist." in err
    assert "--model nope" in err


@pytest.mark.parametrize("args,message", [
    (["--model", "m"], "--base-url"),
    (["--base-url", "localhost:8000", "--model", "m"], "--base-url must look like http://HOST:PORT"),
    (["--base-url", "http://h:1/v1", "--model", "m"], "drop /v1 from --base-url"),
    (["--base-url", "http://h:1", "--model", "m", "--endpoint", "/generate"], "--endpoint must be"),
    (["--base-url", "http://h:1", "--model", "m", "--input-len", "9:3"], "LOW:HIGH"),
    (["--base-url", "http://h:1", "--model", "m", "--request-rate", "0"], "rate must be > 0"),
    (["--base-url", "http://h:1", "--model", "m", "--request-rate", "2", "--sweep-rates", "1,2"],
     "either --request-rate or --sweep-rates"),
    (["--base-url", "http://h:1", "--model", "m", "--goodput", "itl:50"], "unknown metric 'itl'"),
    (["--base-url", "http://h:1", "--model", "m", "--goodput", "ttft:fast"], "milliseconds"),
    (["--base-url", "http://h:1", "--model", "m", "--percentiles", "50,150"], "(0, 100]"),
    (["--base-url", "http://h:1", "--model", "m", "--burstiness", "-1"], "--burstiness"),
    (["--base-url", "http://h:1", "--model", "m", "--arrival", "constant", "--burstiness", "0.5"],
     "no meaning with --arrival constant"),
    (["--base-url", "http://h:1", "--model", "m", "--max-concurrency", "0"], "--max-concurrency"),
    (["--base-url", "http://h:1", "--model", "m", "--endpoint", "/v1/chat/completions",
      "--prompt-format", "ids"], "chat endpoints take text"),
    (["--base-url", "http://h:1", "--model", "m", "--workload", "prefix-repetition",
      "--num-prompts", "5"], "drop --num-prompts 5 or make it 32"),
    (["--base-url", "http://h:1", "--model", "m", "--long-fraction", "2"], "--long-fraction"),
    (["--base-url", "http://h:1", "--model", "m", "--extra-body", "[1]"], "JSON object"),
])
def test_bad_arguments_exit_2_with_a_clear_message(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("body,expected", [
    ('{"error": {"message": "bad prompt", "code": 400}}', "bad prompt"),
    ('{"object": "error", "message": "too long"}', "too long"),
    ('{"detail": "Not Found"}', "Not Found"),
    ("<html>502 Bad Gateway</html>", "<html>502 Bad Gateway</html>"),
    ("", "(empty body)"),
])
def test_error_message_extracts_the_servers_words(body, expected):
    assert error_message(body) == expected


def test_a_prompt_shorter_than_the_chat_template_exits_2_before_sending(fake_server, capsys):
    server = fake_server(lambda body, i: Script())
    rc = main(["--base-url", server.base_url, "--model", "m", "--endpoint", "/v1/chat/completions",
               "--input-len", "3", "--num-prompts", "2", "--no-progress"])
    assert rc == 2 and server.requests == []
    assert capsys.readouterr().err == (f"[bench] a prompt of 3 tokens cannot be made: {TEMPLATE_TOKENS + 1} tokens "
                                       "already with one word (chat template and BOS included); ask for a longer "
                                       "--input-len\n")
