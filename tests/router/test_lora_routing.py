"""Adapter-aware routing (router/lora.py): a request under an adapter goes only to workers
that have it loaded, to those with it in a slot first (no swap), and spreads to the others
when the resident ones are busier by more than the slack; the body of the runtime
load/unload endpoints is checked in one line."""

from __future__ import annotations

import pytest

from splitserve.cluster.messages import LoadReport
from splitserve.router.errors import APIError
from splitserve.router.lora import lora_candidates, parse_lora_body


def report(worker: str, running: int = 0, loras=(), resident=()) -> LoadReport:
    return LoadReport(worker, "decode", 0, running, 0.1, loras={n: 7 for n in loras}, resident_loras=list(resident))


def test_only_workers_with_the_adapter_and_resident_first():
    loads = {"a": report("a", loras=["x"]), "b": report("b", loras=["x"], resident=["x"]), "c": report("c")}
    assert lora_candidates(["a", "b", "c"], [], loads, None) == ["a", "b", "c"]  # the base model: everyone
    assert lora_candidates(["a", "b", "c"], ["a", "b"], loads, "x") == ["b"]
    assert lora_candidates(["a", "c"], ["a"], loads, "x") == ["a"]  # loaded, not resident: only where loaded
    assert lora_candidates(["a", "b", "c"], [], loads, "unknown") == ["a", "b", "c"]  # none known to have it
    del loads["b"]  # b's report expired: it still has x (the router remembers), but is not known resident
    assert lora_candidates(["a", "b", "c"], ["a", "b"], loads, "x") == ["a", "b"]


def test_a_hot_adapter_spreads_past_the_slack():
    loads = {"a": report("a", running=2, loras=["x"]), "b": report("b", running=6, loras=["x"], resident=["x"])}
    assert lora_candidates(["a", "b"], ["a", "b"], loads, "x") == ["b"]  # 6 <= 2 + 4: stay where resident
    loads["b"] = report("b", running=7, loras=["x"], resident=["x"])
    assert lora_candidates(["a", "b"], ["a", "b"], loads, "x") == ["a", "b"]  # 7 > 2 + 4: either


@pytest.mark.parametrize("body,need_path,message", [
    (b"{}", True, "'lora_name' must be a non-empty string"),
    (b'{"lora_name": "x"}', True, "'lora_path' must be a non-empty string"),
    (b'{"lora_name": " "}', False, "'lora_name' must be a non-empty string"),
    (b"[1]", False, "the body must be a JSON object"),
    (b"{", False, "the body must be a JSON object"),
])
def test_bad_bodies_are_one_line_400s(body, need_path, message):
    with pytest.raises(APIError) as err:
        parse_lora_body(body, need_path)
    assert err.value.status == 400 and message in str(err.value) and "\n" not in str(err.value)


def test_good_bodies():
    assert parse_lora_body(b'{"lora_name": "x", "lora_path": "/a"}', True) == ("x", "/a")
    assert parse_lora_body(b'{"lora_name": "x"}', False) == ("x", "")


async def test_a_runtime_change_outlives_a_report_built_before_it():
    """The router records a runtime load / unload at once; a load report the worker built
    just before the change (still listing the old adapters) does not undo it, and the
    first report that shows the change ends the override. A real in-process bus and
    IndexSync carry the reports."""
    from splitserve.cluster.inproc_bus import InProcBus
    from splitserve.cluster.messages import WorkerInfo
    from splitserve.router.index_sync import IndexSync
    from splitserve.router.lora import RouterLoRA
    from splitserve.router.radix_index import RadixIndex
    from splitserve.security.links import NO_SECURITY

    bus = InProcBus()
    sync = IndexSync(bus, RadixIndex(), model="m", block_size=16)
    await bus.register(WorkerInfo("d", "decode", "127.0.0.1:1", "m", 16, 100), ttl=30)
    loras = RouterLoRA(sync, NO_SECURITY, "m")

    async def reported(adapters: dict) -> dict:
        await bus.publish_load(LoadReport("d", "decode", 0, 0, 0.0, loras=adapters), ttl=30)
        await sync.refresh()
        return loras.adapters()

    assert await reported({"a": 5}) == {"a": 5}
    loras._record("d", "b", 9)  # what a runtime load that every worker accepted records
    assert await reported({"a": 5}) == {"a": 5, "b": 9}  # a report from before the load
    assert await reported({"a": 5, "b": 9}) == {"a": 5, "b": 9} and not loras._pending["d"]
    loras._record("d", "a", None)  # unloaded
    assert await reported({"a": 5, "b": 9}) == {"b": 9}
    assert await reported({"b": 9}) == {"b": 9} and not loras._pending["d"]
    assert loras.salt("b") == 9 and loras.salt(None) == 0 and loras.salt("never") not in (0, 9)


async def test_a_request_naming_an_adapter_is_read_again_once_a_new_worker_s_first_report_is_in():
    """A decode worker registered, its first load report (with its adapters) not in yet: a
    request naming its adapter is judged against the models once the report arrives, not
    as "base model only" (a 404); one naming a model that is served does not wait at all,
    and the wait for a worker that never reports is bounded."""
    import asyncio
    import time

    from splitserve.cluster.inproc_bus import InProcBus
    from splitserve.cluster.messages import WorkerInfo
    from splitserve.router import errors, lora
    from splitserve.router.index_sync import IndexSync
    from splitserve.router.lora import RouterLoRA
    from splitserve.router.radix_index import RadixIndex
    from splitserve.security.links import NO_SECURITY

    bus = InProcBus()
    sync = IndexSync(bus, RadixIndex(), model="m", block_size=16)
    await bus.register(WorkerInfo("d", "decode", "127.0.0.1:1", "m", 16, 100), ttl=30)
    await sync.refresh()
    loras = RouterLoRA(sync, NO_SECURITY, "m")
    assert sync.live("decode") == ["d"] and loras.models() == ["m"]  # registered, no report yet

    def asking_for(model: str):
        async def parse(served: list[str]) -> str:
            if model not in served:
                raise errors.model_not_found(model, served)
            return model
        return parse

    async def first_report_later():
        await asyncio.sleep(0.3)
        await bus.publish_load(LoadReport("d", "decode", 0, 0, 0.0, loras={"sql": 7}), ttl=30)
        await sync.refresh()

    late = asyncio.create_task(first_report_later())
    started = time.monotonic()
    assert await loras.judged(asking_for("m")) == "m" and time.monotonic() - started < 0.1  # served: no wait
    assert await loras.judged(asking_for("sql")) == "sql"  # read again once d's report listed it
    await late
    await bus.register(WorkerInfo("e", "decode", "127.0.0.1:2", "m", 16, 100), ttl=30)
    await sync.refresh()
    started = time.monotonic()
    with pytest.raises(errors.APIError) as refused:  # e never reports: a 404 after a bounded wait
        await loras.judged(asking_for("nope"))
    assert refused.value.status == 404 and "it serves: m, sql" in refused.value.message
    assert lora.FIRST_REPORT_WAIT_S - 0.1 < time.monotonic() - started < lora.FIRST_REPORT_WAIT_S + 1.5
