"""One engine handle (engine/handle.py): LLMEngine, AsyncEngine and EngineProcess have the
same calls with the same signatures, each handle's call reaches the LLMEngine method of its
name with its arguments in place, and over the process pipe only those names cross."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from splitserve.decode_worker import peer_pull
from splitserve.engine import EngineConfig
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.engine_process import EngineProcess
from splitserve.engine.handle import CALLS, EngineCalls, EngineHandle
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.lora.adapter import LoRAAdapterError

HANDLES = (AsyncEngine, EngineProcess)


def test_the_calls_are_the_ones_workers_make():
    assert CALLS == {"add_request", "abort", "reserve_remote_prefill", "complete_remote_prefill",
                     "cancel_remote_prefill", "held_blocks", "release_held", "held_summary", "cached_block_hashes",
                     "reserve_pull", "adopt_pulled", "drop_pulled", "pin_prefix", "unpin", "add_lora", "remove_lora"}
    assert all(EngineHandle in cls.__mro__ for cls in HANDLES)  # (explicitly: the calls come from it)
    # each handle says how a call reaches its engine; none writes a call of its own
    for cls in HANDLES:
        assert cls._invoke is not EngineCalls._invoke
        assert inspect.iscoroutinefunction(cls._invoke)
    # peer pulls call the handle, not a private method of one kind of it
    source = inspect.getsource(peer_pull)
    assert "AsyncEngine" not in source and "EngineProcess" not in source and "._call(" not in source


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_class_has_the_call_with_the_protocols_signature(name):
    want = inspect.signature(getattr(EngineCalls, name))
    for cls in HANDLES:
        got = getattr(cls, name)
        assert inspect.iscoroutinefunction(got), f"{cls.__name__}.{name} is not awaitable"
        assert inspect.signature(got) == want, f"{cls.__name__}.{name}{inspect.signature(got)} != {want}"
    # the engine itself: synchronous, the same parameters first (names, kinds, defaults); what
    # it takes more must be optional (add_request's detokenize). Its annotations may be wider
    # (a text prompt) and its results richer (add_request's Sequence).
    method = getattr(LLMEngine, name)
    assert not inspect.iscoroutinefunction(method)
    params = list(inspect.signature(method).parameters.values())
    assert [(p.name, p.kind, p.default) for p in params[:len(want.parameters)]] == \
           [(p.name, p.kind, p.default) for p in want.parameters.values()], f"LLMEngine.{name} drifted"
    assert all(p.default is not inspect.Parameter.empty for p in params[len(want.parameters):]), name


class Recorder(EngineCalls):
    def __init__(self):
        self.seen: list[tuple[str, tuple, bool]] = []

    async def _invoke(self, method, *args, result=True):
        self.seen.append((method, args, result))


@pytest.mark.parametrize("name", sorted(CALLS))
async def test_each_call_reaches_the_engine_method_of_its_name_with_its_arguments_in_place(name):
    want = inspect.signature(getattr(EngineCalls, name))
    args = [object() for _ in list(want.parameters)[1:]]  # one distinct value per parameter
    handle = Recorder()
    await getattr(handle, name)(*args)
    (method, forwarded, _), = handle.seen
    assert method == name
    bound = inspect.signature(getattr(LLMEngine, name)).bind(None, *forwarded)
    for param, value in zip(list(want.parameters)[1:], args, strict=True):
        assert bound.arguments[param] is value, f"{name}: {param} lands elsewhere"
    if name in ("add_request", "reserve_remote_prefill"):  # a worker never asks for text
        assert bound.arguments["detokenize"] is False


async def test_an_engine_process_answers_its_calls_by_name_and_no_other(make_ckpt):
    proc = EngineProcess(EngineConfig(model=str(make_ckpt("llama")), num_kv_blocks=16), asyncio.get_running_loop(),
                         lambda outputs: None, name="handle")
    await asyncio.to_thread(proc.launch)
    proc.start()
    try:
        assert await proc.held_summary() == {}
        assert await proc.pin_prefix([5] * 16, 0) == ([], [])  # nothing cached: nothing pinned
        assert await proc.abort("nobody") is False
        with pytest.raises(LoRAAdapterError, match=r"^LoRA adapters are not enabled on this worker"):
            await proc.add_lora("a", "/nowhere")  # the engine's own error, as itself
        with pytest.raises(AttributeError, match=r"^'close' is not an engine call \(handle.CALLS\)$"):
            await proc._invoke("close")
        assert proc.alive and await proc.cached_block_hashes() == []  # the engine still serves
    finally:
        proc.stop()
