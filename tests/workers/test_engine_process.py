"""Workers whose engine loop runs in a child process (engine/engine_process.py): the same
tokens as one engine, KV pushed into and read out of the shared pool, and the child's death
treated as the engine's death, whichever side dies first."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine import LLM, EngineConfig, SamplingParams
from splitserve.engine.engine_process import EngineProcess, use_engine_process
from splitserve.prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from tests.workers.test_workers_grpc import generate


def engine_config(path):
    return EngineConfig(model=str(path), num_kv_blocks=64, model_id="test-model")


def test_a_kv_pool_larger_than_dev_shm_is_refused_with_what_to_do(tmp_path):
    from splitserve.engine.engine_child import check_shared_memory

    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    check_shared_memory(free // 2, str(tmp_path))  # fits: nothing said
    with pytest.raises(RuntimeError, match=r"does not fit in .* --shm-size.*--engine-loop thread"):
        check_shared_memory(free + 2**30, str(tmp_path))


async def test_an_engine_process_that_cannot_start_says_why(make_ckpt, tmp_path):
    """The child's start-up error reaches the worker's start as itself (a clear CLI line)."""
    broken = tmp_path / "broken"
    shutil.copytree(make_ckpt("llama"), broken)
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": "wide"}')
    proc = EngineProcess(EngineConfig(model=str(broken), num_kv_blocks=64), asyncio.get_running_loop(),
                         lambda outputs: None, name="bad")
    with pytest.raises(Exception) as err:
        await asyncio.to_thread(proc.launch)
    assert "exited while starting" not in str(err.value)  # the child's own reason, not a guess
    assert not proc.alive


def test_default_is_a_process_on_the_cpu_and_a_thread_on_cuda(make_ckpt):
    path = str(make_ckpt("llama"))
    assert use_engine_process(EngineConfig(model=path), None) is True
    assert use_engine_process(EngineConfig(model=path, device="cuda"), None) is False
    assert use_engine_process(EngineConfig(model=path), False) is False


@pytest.mark.parametrize("choice", ["auto", "system"])
async def test_the_engine_process_runs_on_tcmalloc_unless_told_not_to(make_ckpt, monkeypatch, caplog, choice):
    """tcmalloc is preloaded into the engine process only (`make test` installs
    libtcmalloc-minimal4, as the image does): mapped there, absent from this process, and this
    process's LD_PRELOAD as it was; `SPLITSERVE_ENGINE_MALLOC=system` keeps glibc's malloc."""
    from splitserve.engine import allocator

    assert allocator.find_tcmalloc(), "libtcmalloc-minimal4 is not installed (scripts/setup.sh installs it)"
    monkeypatch.setenv(allocator.ENV, choice)
    monkeypatch.setenv("LD_PRELOAD", "")  # one already there stays, tcmalloc goes first
    proc = EngineProcess(engine_config(make_ckpt("llama")), asyncio.get_running_loop(), lambda outputs: None,
                         name="alloc")
    await asyncio.to_thread(proc.launch)
    try:
        with open(f"/proc/{proc.pid}/maps") as f:
            mapped = "libtcmalloc_minimal" in f.read()
        with open(f"/proc/{proc.pid}/environ", "rb") as f:
            child_env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    finally:
        proc.stop()
    assert mapped == (choice == "auto")
    assert os.environ["LD_PRELOAD"] == "" and allocator.allocator_in_use() == "glibc malloc"
    assert child_env[b"LD_PRELOAD"].startswith(b"libtcmalloc_minimal") == (choice == "auto")
    assert child_env[b"THP_MEM_ALLOC_ENABLE"] == b"1" and "THP_MEM_ALLOC_ENABLE" not in os.environ


def test_an_explicit_huge_pages_choice_reaches_the_engine_process_as_given(monkeypatch):
    """THP_MEM_ALLOC_ENABLE=0 in the environment opts the engine out of torch's huge pages."""
    from splitserve.engine import allocator

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with allocator.engine_environment(None):
        assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0" and "LD_PRELOAD" not in os.environ
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    with allocator.engine_environment("libtcmalloc_minimal.so.4"):
        assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
        assert os.environ["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"
    assert "THP_MEM_ALLOC_ENABLE" not in os.environ and "LD_PRELOAD" not in os.environ


def test_a_wrong_allocator_choice_is_refused_by_name(monkeypatch):
    from splitserve.engine import allocator

    monkeypatch.setenv(allocator.ENV, "jemalloc")
    with pytest.raises(ValueError, match="SPLITSERVE_ENGINE_MALLOC='jemalloc' is not one of auto, tcmalloc, system"):
        allocator.engine_preload()
    monkeypatch.setenv(allocator.ENV, "tcmalloc")
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    with pytest.raises(RuntimeError, match="apt-get install libtcmalloc-minimal4"):
        allocator.engine_preload()


@pytest.mark.parametrize("kv_backend", ["grpc", "mooncake"])
async def test_disaggregated_generation_through_engine_processes_matches_one_engine(make_ckpt, kv_backend):
    path = make_ckpt("llama")
    rng = random.Random(3)
    shared = [rng.randrange(5, 1000) for _ in range(48)]
    prompts = [shared + [rng.randrange(5, 1000) for _ in range(n)] for n in (5, 21)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    expected = LLM(str(path), num_kv_blocks=64).generate(prompts, params)
    bus = InProcBus()
    decode = DecodeWorker(DecodeWorkerConfig(engine_config(path), worker_id="d0", engine_process=True,
                                             kv_backend=kv_backend), bus=bus)
    prefill = PrefillWorker(PrefillWorkerConfig(engine_config(path), worker_id="p0", engine_process=True), bus=bus)
    await asyncio.gather(decode.start(), prefill.start())
    try:
        assert isinstance(decode.engine, EngineProcess) and decode.engine.pid != os.getpid()
        # prefill in p0's process, KV read from its shared pool, pushed into d0's (Mooncake: into the
        # shared pages the worker registered), decoded in d0's process
        chunks = await generate(decode.address, "r0", prompts[0], params, prefill)
        assert [t for c in chunks for t in c.token_ids] == expected[0].token_ids
        got = [(lp.token_id, round(lp.logprob, 4)) for c in chunks for lp in c.logprobs]
        assert got == [(lp.token_id, round(lp.logprob, 4)) for lp in expected[0].logprobs]
        assert chunks[0].prefill_worker_id == "p0" and chunks[0].prefill_fallback == ""
        # the shared prefix is cached in d0's engine: only the rest is pushed
        chunks = await generate(decode.address, "r1", prompts[1], params, prefill)
        assert [t for c in chunks for t in c.token_ids] == expected[1].token_ids
        assert chunks[0].num_cached_tokens == 48
        await asyncio.sleep(0.3)  # the child's stats after the last step reach the parent
        assert decode.kv_state()["free_blocks"] == decode.kv_state()["total_blocks"] == 64
        assert decode.engine.steps > 0 and prefill.engine.steps > 0
        events = await bus.read_kv({"d0": "0-0"})  # KV events crossed the pipe to the bus
        assert any(r.event.kind == "stored" for r in events)
        # a bad prompt's InvalidPromptError crosses the pipe: INVALID_ARGUMENT, not a dead engine
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(decode.address, "bad", [10**7], SamplingParams(max_tokens=3))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and decode.engine.alive
    finally:
        await asyncio.gather(decode.stop(), prefill.stop())


async def test_a_killed_engine_process_fails_its_streams_and_its_worker(make_ckpt):
    decode = DecodeWorker(DecodeWorkerConfig(engine_config(make_ckpt("llama")), worker_id="d-kill",
                                             engine_process=True), bus=InProcBus())
    await decode.start()
    try:
        from splitserve.proto.convert import pb, sampling_to_proto
        from splitserve.proto.worker_pb2_grpc import DecodeWorkerStub

        async with grpc.aio.insecure_channel(decode.address) as ch:
            call = DecodeWorkerStub(ch).Generate(pb.GenerateRequest(
                request_id="r", prompt_token_ids=list(range(5, 40)),
                sampling=sampling_to_proto(SamplingParams(max_tokens=900, ignore_eos=True))))
            await call.read()
            os.kill(decode.engine.pid, signal.SIGKILL)  # the OOM killer's way
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while True:
                    await asyncio.wait_for(call.read(), 10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # retryable: the router migrates it
        assert "engine process died" in err.value.details() and "exit code -9" in err.value.details()
        await asyncio.wait_for(decode.fatal.wait(), 5)
        ok, status, detail = await decode.health()
        assert not ok and status == "failed" and "exit code -9" in detail
        with pytest.raises(Exception, match="dead"):
            await decode.engine.abort("r")
    finally:
        await decode.stop()


CHILD_OF = textwrap.dedent("""
    import asyncio, sys
    from splitserve.engine import EngineConfig
    from splitserve.engine.engine_process import EngineProcess

    async def main():
        proc = EngineProcess(EngineConfig(model=sys.argv[1], num_kv_blocks=16), asyncio.get_running_loop(),
                             lambda outputs: None)
        await asyncio.to_thread(proc.launch)
        proc.start()
        print(proc.pid, flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
""")


def test_the_engine_process_dies_with_its_parent(make_ckpt):
    parent = subprocess.Popen([sys.executable, "-c", CHILD_OF, str(make_ckpt("llama"))], stdout=subprocess.PIPE,
                              text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # alive
        parent.kill()  # SIGKILL: no cleanup of any kind runs in the parent
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail(f"engine process {child} outlived its parent")
    finally:
        parent.kill()
