"""`splitserve bench serve-overhead` runs one workload offline and through `splitserve serve`
and splits the served CPU per token between the serve process, the workers' engine steps and
the workers' serving path around them."""

from __future__ import annotations

import json

from splitserve.benchmark import serve_overhead


def test_serve_overhead_reports_both_sides_and_the_cpu_split(make_ckpt, tmp_path):
    out = tmp_path / "overhead.json"
    assert serve_overhead.main(["--model", str(make_ckpt("llama")), "--requests", "6", "--concurrency", "3",
                                "--input-len", "20:40", "--output-len", "8:12", "--threads", "1",
                                "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["offline"]["output_tokens"] == doc["served"]["output_tokens"]  # same workload, all of it
    assert doc["offline_at_concurrency"]["output_tokens"] == doc["served"]["output_tokens"]
    assert (doc["offline"]["max_num_seqs"], doc["offline_at_concurrency"]["max_num_seqs"]) == (64, 3)
    assert 0 < decode_busy(doc) <= 1.05
    assert 6 * 8 <= doc["served"]["output_tokens"] <= 6 * 12 and doc["served"]["failed"] == 0
    cpu = doc["served"]["cpu"]
    assert set(cpu) == {"serve", "decode-0", "prefill-0"}
    decode = cpu["decode-0"]
    assert decode["engine_step_cpu_s_per_token"] > 0 and cpu["serve"]["process_cpu_s_per_token"] > 0
    assert cpu["serve"]["engine_busy_fraction"] == 0  # no engine in the serve process
    assert abs(decode["engine_step_cpu_s_per_token"] + decode["outside_steps_cpu_s_per_token"]
               - decode["process_cpu_s_per_token"]) < 1e-9


def decode_busy(doc) -> float:
    return doc["served"]["cpu"]["decode-0"]["engine_busy_fraction"]
