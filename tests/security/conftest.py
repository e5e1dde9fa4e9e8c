"""A real serving stack in this process, every gRPC link over mutual TLS: a decode
worker, a prefill worker (KV pushed between them), the embedded bus bridge, and the
router's aiohttp app on a real port with an API key. It runs on its own event loop
thread, so synchronous tests (requests, schemathesis) and raw gRPC clients hit it."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
from aiohttp import web

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.cluster.remote_bus import BusServicer
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine import EngineConfig
from splitserve.prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from splitserve.proto.worker_pb2_grpc import add_BusServicer_to_server
from splitserve.router.dispatch import DispatchConfig, Dispatcher
from splitserve.router.policy import PolicyConfig
from splitserve.router.server import RouterServer, ServerConfig
from splitserve.security.links import LinkSecurity
from tests.helpers.processes import free_port
from tests.security.certs import CertFiles, make_pki

SERVED = "tiny-llama"
API_KEY = "sk-test-7f3a9c"
MAX_MODEL_LEN = 96  # keeps every generation the fuzzers ask for short


@dataclass
class Stack:
    base_url: str
    decode: DecodeWorker
    prefill: PrefillWorker
    bridge_address: str
    server: RouterServer
    certs: CertFiles
    impostor: CertFiles
    loop: asyncio.AbstractEventLoop

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {API_KEY}"}

    def ports(self) -> dict[str, str]:
        """Every gRPC port of the stack."""
        return {"decode": self.decode.address, "kv-receiver": self.decode.kv_address,
                "prefill": self.prefill.address, "bus-bridge": self.bridge_address}

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def kv_states(self) -> list[dict]:
        return [self.decode.kv_state(), self.prefill.kv_state()]

    def wait_all_blocks_free(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while True:
            d, p = self.kv_states()
            if (d["free_blocks"] == d["total_blocks"] and not d["sequences"] and not d["remote_prefills"]
                    and not d["kv_leases"] and p["free_blocks"] == p["total_blocks"] and not p["held_for_push"]
                    and not p["sequences"] and not self.decode.streams):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"KV blocks still in use: {d} {p}")
            time.sleep(0.1)


@pytest.fixture(scope="session")
def stack(make_ckpt, tmp_path_factory):
    model = make_ckpt("llama")
    pki = tmp_path_factory.mktemp("pki")
    certs, impostor = make_pki(pki, "cluster"), make_pki(pki, "impostor")
    security = LinkSecurity(tls=certs.tls())
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="security-stack")
    thread.start()

    async def start():
        engine = EngineConfig(model=str(model), num_kv_blocks=96, model_id=SERVED, max_model_len=MAX_MODEL_LEN)
        bus = InProcBus()
        bridge = security.aio_server()
        add_BusServicer_to_server(BusServicer(bus), bridge)
        bridge_port = security.add_port(bridge, "127.0.0.1:0")
        await bridge.start()
        decode = DecodeWorker(DecodeWorkerConfig(engine, worker_id="d0", security=security, admin_port=None), bus=bus)
        prefill = PrefillWorker(PrefillWorkerConfig(engine, worker_id="p0", security=security), bus=bus)
        await asyncio.gather(decode.start(), prefill.start())
        dispatcher = Dispatcher(DispatchConfig(model_id=SERVED, security=security, seed=7,
                                               policy=PolicyConfig(disagg_min_uncached_tokens=24,
                                                                   strict_disaggregation=True)), bus)
        await dispatcher.start()
        while len(dispatcher.sync.workers) < 2:
            await dispatcher.sync.refresh()
            await asyncio.sleep(0.05)
        server = RouterServer(ServerConfig(str(model), SERVED, api_key=API_KEY, max_model_len=MAX_MODEL_LEN),
                              dispatcher)
        runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return (Stack(f"http://127.0.0.1:{port}", decode, prefill, f"127.0.0.1:{bridge_port}", server, certs,
                      impostor, loop), runner, dispatcher, bridge)

    s, runner, dispatcher, bridge = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    yield s

    async def stop():
        await runner.cleanup()
        await dispatcher.stop()
        await asyncio.gather(s.decode.stop(), s.prefill.stop())
        await bridge.stop(grace=1)

    asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
