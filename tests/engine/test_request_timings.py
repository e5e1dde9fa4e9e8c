"""Where a first token's time goes inside the engine: the first output of a request it
prefilled carries its queue time (arrival to the first step that computed its prompt) and
its prefill time (that step to the first token), vLLM's request_queue_time and
request_prefill_time. A clock that reads the step number makes them exact."""

from __future__ import annotations

import pytest

import splitserve.engine.scheduler as scheduler_module
import splitserve.engine.sequence as sequence_module
from splitserve.engine import EngineConfig, SamplingParams
from splitserve.engine.llm_engine import LLMEngine


class StepClock:
    """monotonic() reads `now`: the scheduler sees a step's start, the engine its end."""

    def __init__(self, offset: float):
        self.now, self.offset = 0.0, offset

    def monotonic(self) -> float:
        return self.now + self.offset


@pytest.fixture
def engine(make_ckpt, monkeypatch):
    start, end = StepClock(0.0), StepClock(0.5)
    monkeypatch.setattr(scheduler_module, "time", start)
    monkeypatch.setattr(sequence_module, "time", end)
    eng = LLMEngine(EngineConfig(model=str(make_ckpt("llama")), num_kv_blocks=64, max_num_batched_tokens=64))
    return eng, (start, end)


def run(eng, clocks) -> list:
    outputs, step = [], 0
    while eng.has_unfinished_requests():
        for clock in clocks:
            clock.now = float(step)
        outputs += eng.step()
        step += 1
    return outputs


def test_first_outputs_say_how_long_the_request_queued_and_prefilled(engine):
    eng, clocks = engine
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
    eng.add_request("long", list(range(5, 205)), params)  # 200 tokens: chunks of 64, 64, 64, 8
    eng.add_request("short", list(range(5, 15)), params)  # waits for the budget the last chunk leaves
    for seq in eng.sequences.values():
        seq.arrival_time = 0.0
    outputs = run(eng, clocks)

    first = {o.request_id: o for o in outputs if len(o.token_ids) == 1}
    assert (first["long"].queue_s, first["long"].prefill_s) == (0.0, 3.5)  # steps 0-3, token at 3's end
    assert (first["short"].queue_s, first["short"].prefill_s) == (3.0, 0.5)  # admitted at step 3
    later = [o for o in outputs if len(o.token_ids) > 1]
    assert len(later) == 4 and all(o.queue_s is None and o.prefill_s is None for o in later)


def test_a_request_prefilled_elsewhere_reports_no_prefill_here(engine):
    """Decode side of a disaggregated request: the prefill worker reports its timings."""
    eng, clocks = engine
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)
    assert eng.reserve_remote_prefill("remote", list(range(5, 40)), params) is not None
    out = eng.complete_remote_prefill("remote", 7, None)
    assert out.token_ids == [7] and out.queue_s is None and out.prefill_s is None
    assert all(o.queue_s is None for o in run(eng, clocks))
