"""Conditional disaggregation through the dispatcher (router/prefill_placement.py): a burst of
long prompts arriving between two load reports is split between the prefill worker and the
decode worker by the prompt tokens this router already sent each, not all queued behind the
prefill worker; an idle decode worker prefills a prompt itself; --strict-disaggregation
sends every one to the prefill worker."""

from __future__ import annotations

import time

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.cluster.messages import LoadReport, WorkerInfo
from splitserve.router.dispatch import DispatchConfig, Dispatcher
from splitserve.router.index_sync import WorkerState
from splitserve.router.policy import PolicyConfig

BS = 16


def dispatcher(strict: bool = False, decode_running: int = 1) -> Dispatcher:
    """One decode and one prefill worker; the decode worker's last report shows
    `decode_running` streams (1 by default: it is not idle)."""
    d = Dispatcher(DispatchConfig(model_id="m", block_size=BS, seed=0,
                                  policy=PolicyConfig(strict_disaggregation=strict)), InProcBus())
    for worker, role in (("d1", "decode"), ("p1", "prefill")):
        d.sync.workers[worker] = WorkerState(WorkerInfo(worker, role, f"{worker}:1", "m", BS, 1024))
        d.sync.loads[worker] = LoadReport(worker, role, 0, decode_running if role == "decode" else 0, 0.0,
                                          waiting_tokens=0, timestamp=time.time() - 1)
    return d


def prompt(i: int, length: int = 600) -> list[int]:
    return [1000 * i + t for t in range(length)]  # distinct: no prefix is shared


def test_a_burst_alternates_between_the_prefill_worker_and_a_local_prefill():
    d = dispatcher()
    paths = [d.decide(prompt(i))[0] for i in range(5)]
    # queues (decode, prefill): (0, 0) tie -> p1; (0, 600) -> local; (600, 600) tie -> p1; ...
    assert [(x.path, x.prefill_worker) for x in paths] == [
        ("disaggregated", "p1"), ("local", None), ("disaggregated", "p1"), ("local", None), ("disaggregated", "p1")]
    assert paths[1].prefill_reason == ("local: the prefill worker has 600 prompt tokens queued, the decode worker 0: "
                                       "these 600 finish sooner there")


def test_a_shorter_local_backlog_takes_a_prompt_even_when_the_prefill_worker_could_start_first():
    d = dispatcher()
    d.sync.loads["p1"] = LoadReport("p1", "prefill", 1, 1, 0.0, waiting_tokens=100)
    assert d.decide(prompt(0))[0].path == "local"  # 0 < 100: it finishes at 600 here, at 700 there


def test_a_new_load_report_replaces_what_was_counted_since_the_last():
    d = dispatcher()
    assert d.decide(prompt(0))[0].path == "disaggregated"
    # p1 reports its queue empty again (the prompt is done): the next goes there too
    d.sync.loads["p1"] = LoadReport("p1", "prefill", 0, 0, 0.0, waiting_tokens=0)
    assert d.decide(prompt(1))[0].path == "disaggregated"


def test_strict_disaggregation_queues_the_whole_burst_on_the_prefill_worker():
    d = dispatcher(strict=True)
    assert {d.decide(prompt(i))[0].prefill_worker for i in range(5)} == {"p1"}


def test_a_prompt_whose_first_token_came_back_no_longer_counts_as_backlog():
    """Sequential requests between two load reports: the first one's prefill is done when the
    second is routed, so it does not push the second off the prefill worker."""
    d = dispatcher()
    first = d.decide(prompt(0))[0]
    assert first.path == "disaggregated"
    d.backlog.settle(first)  # what generate() does at the first streamed chunk
    assert d.decide(prompt(1))[0].path == "disaggregated"
    assert not d.backlog._unsettled.get(id(first))


def test_an_idle_decode_worker_prefills_the_prompt_itself():
    d = dispatcher(decode_running=0)
    first = d.decide(prompt(0))[0]
    assert (first.path, first.prefill_reason) == ("local", "local: the decode worker is idle: its 600 prompt tokens "
                                                           "slow no stream there and their KV need not move")
    # it was sent a request (not yet ended): no longer idle, and its backlog is the longer queue
    assert d.decide(prompt(1))[0].prefill_worker == "p1"


def test_a_worker_whose_reported_streams_were_all_ours_and_ended_is_idle_again():
    """c = 1 between two load reports: the report still counts our last request as running,
    but that call ended after the report, so the next prompt is prefilled locally."""
    assert dispatcher(decode_running=1).decide(prompt(0))[0].path == "disaggregated"  # someone's stream runs there
    d = dispatcher(decode_running=1)
    d.backlog._ended["d1"] = [time.time()]  # the reported stream was a call of ours, ended after the report
    assert d.decide(prompt(0))[0].path == "local"
    busy = dispatcher(decode_running=0)
    busy._calls["d1"] = {object()}  # one of our calls in flight there
    assert busy.decide(prompt(0))[0].path == "disaggregated"


def test_calls_that_ended_before_the_report_do_not_make_its_streams_ours():
    d = dispatcher(decode_running=1)
    d.backlog._ended["d1"] = [time.time() - 5]  # ended before the report was taken: the reported stream is another's
    assert d.decide(prompt(0))[0].path == "disaggregated"


def test_strict_disaggregation_sends_even_an_idle_worker_s_prompt_away():
    assert dispatcher(strict=True, decode_running=0).decide(prompt(0))[0].prefill_worker == "p1"
