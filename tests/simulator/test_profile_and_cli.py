"""`splitserve profile` probes on a real (tiny) engine and KV transfer, and the
`splitserve simulate` command line."""

import json

import pytest

from splitserve.simulator import main as simulate_cli
from splitserve.simulator.costs import (
    AffineCost,
    CostModel,
    ServingOverhead,
    StepCost,
    attention_work,
)
from splitserve.simulator.profile import StepProbe, _engine, fit, profile_routing, profile_transfer


@pytest.fixture(scope="module")
def probe(make_ckpt):
    return StepProbe(_engine(str(make_ckpt("llama")), 256, 16))


def test_prefill_probe_reports_the_batch_the_engine_ran(probe):
    seconds, feats = probe.prefill(40, 32)
    assert seconds > 0
    # 32 cached tokens (two blocks) were reused; 40 new ones computed in one step
    assert feats == {"new_tokens": 40, "sequences": 1, "attention": attention_work(40, 32), "decode_context": 0}


def test_decode_probe_reports_batch_and_context(probe):
    samples = probe.decode(3, 48, repeats=2)
    # 48-token prompts, prefilled, one warm-up decode step: each holds 49 tokens of KV,
    # then 50 on the second timed step
    assert [f for _, f in samples] == [
        {"new_tokens": 3, "sequences": 3, "attention": 0, "decode_context": 3 * 50},
        {"new_tokens": 3, "sequences": 3, "attention": 0, "decode_context": 3 * 51},
    ]
    assert not probe.engine.has_unfinished_requests()


def test_mixed_probe_adds_a_prefill_chunk_to_the_decode_batch(probe):
    (_, feats), = probe.decode(2, 32, repeats=1, prefill_chunk=20)
    assert feats["new_tokens"] == 2 + 20 and feats["sequences"] == 3
    assert feats["attention"] == attention_work(20, 0)
    assert feats["decode_context"] == 2 * 34


def test_transfer_probe_moves_real_blocks_over_grpc(make_ckpt):
    rows, per_token = profile_transfer(str(make_ckpt("llama")), "grpc", 1, lambda _: None, sizes=(1, 4))
    assert [r["blocks"] for r in rows] == [1, 4]
    assert rows[1]["bytes"] == 4 * rows[0]["bytes"] == 4 * 16 * per_token
    assert all(r["seconds"] > 0 for r in rows)


def test_routing_probe_and_fit_produce_a_cost_model():
    routing = profile_routing(workers=4, prompt_tokens=256, repeats=1)
    assert routing["mean_s"] > 0
    steps = [{"new_tokens": n, "sequences": 1, "attention": attention_work(n, 0), "decode_context": 0,
              "seconds": 0.001 + n * 1e-5} for n in (16, 64, 256, 1024)]
    steps += [{"new_tokens": b, "sequences": b, "attention": 0, "decode_context": b * 100,
               "seconds": 0.001 + b * 1e-5} for b in (1, 8)]
    doc = {"samples": {"steps": steps, "routing": routing, "kv_bytes_per_token": 512,
                       "transfer": [{"bytes": b, "seconds": 1e-3 + b * 1e-9} for b in (1e4, 1e5, 1e6)]}}
    costs = fit(doc, 2048, 64)
    assert costs.step.c_token == pytest.approx(1e-5)
    assert costs.transfer.per_unit == pytest.approx(1e-9)
    assert costs.routing_s == routing["mean_s"] and costs.kv_bytes_per_token == 512


@pytest.fixture
def profile(tmp_path):
    costs = CostModel(step=StepCost(2e-3, 4e-4, 5e-5, 1e-7, 2e-7), transfer=AffineCost(1e-3, 1e-9),
                      serving=ServingOverhead(2e-3, 0.0), kv_bytes_per_token=2048)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"costs": costs.to_dict()}))
    return path


def test_simulate_command_writes_summary(profile, tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = simulate_cli.main(["--profile", str(profile), "--num-requests", "200", "--rate", "5",
                            "--prompt-len", "32:512", "--output-len", "8:32", "--prefill-workers", "1",
                            "--decode-workers", "2", "--slo-ttft", "500", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["requests"] == 200 and doc["summary"]["requests"] == 200
    assert doc["summary"]["goodput"] is not None
    assert "simulated 200 requests on 1+2 workers" in capsys.readouterr().out


def test_simulate_command_plans(profile, tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = simulate_cli.main(["--profile", str(profile), "--num-requests", "200", "--rate", "5",
                            "--prompt-len", "32:1024", "--output-len", "8:64", "--plan", "--budget", "3",
                            "--slo-ttft", "500", "--slo-tpot", "50", "--out", str(out)])
    assert rc == 0
    best = json.loads(out.read_text())["plan"]["best"]
    assert best["prefill"] + best["decode"] <= 3 and best["decode"] >= 1
    assert "best split:" in capsys.readouterr().out


def test_simulate_command_errors(profile, tmp_path, capsys):
    assert simulate_cli.main(["--profile", str(tmp_path / "nope.json")]) == 2
    assert "cannot read profile" in capsys.readouterr().err
    assert simulate_cli.main(["--profile", str(profile), "--decode-workers", "0"]) == 2
    assert "need >= 1 decode worker" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate_cli.main(["--profile", str(profile), "--plan"])
    assert "--plan needs --slo-ttft" in capsys.readouterr().err
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"runs": [{"completed": 1}]}))
    assert simulate_cli.main(["--profile", str(profile), "--trace", str(bench)]) == 2
    assert "--save-requests" in capsys.readouterr().err


def test_trace_from_bench_reads_requests_and_prefix_groups(tmp_path):
    from splitserve.simulator.workload import trace_from_bench

    rows = [{"request_id": "bench-ab12-req-1-p3s0", "success": True, "send_offset_s": 2.5, "prompt_tokens": 300,
             "output_tokens": 8},
            {"request_id": "bench-ab12-req-0-p1s4", "success": True, "send_offset_s": 1.0, "prompt_tokens": 290,
             "output_tokens": 8},
            {"request_id": "bench-ab12-req-2-p1s1", "success": False, "send_offset_s": 3.0}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"runs": [{"requests": rows}]}))
    trace = trace_from_bench(path, prefix_len=256)
    assert trace.arrival.tolist() == [0.0, 1.5]  # sorted, from the first send, failed request dropped
    assert trace.prompt_len.tolist() == [290, 300]
    assert trace.group.tolist() == [1, 3] and trace.prefix_len.tolist() == [256, 256]
    assert trace_from_bench(path).group.tolist() == [-1, -1]  # no prefix length: no sharing
