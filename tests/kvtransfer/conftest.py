"""Fixtures: a real decode side (KV pool + BlockManager + KVReceiver) in the test process
and real prefill-side sender processes, for both backends."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from dataclasses import dataclass, field

import pytest

from splitserve.core.hashing import block_hashes, hash_seed
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_cache import KVCachePool
from splitserve.kvtransfer import KVReceiver, KVTransferConfig
from tests.kvtransfer import peer

BACKENDS = ("grpc", "mooncake")
DECODE_BLOCKS = 64
CTX = mp.get_context("spawn")


def config_for(backend: str, **overrides) -> KVTransferConfig:
    # 8 KiB chunks split every 16 KiB block in two: the partial-block write path is exercised.
    values = dict(backend=backend, chunk_bytes=8192, timeout_s=10.0, one_sided_quarantine_s=0.2)
    values.update(overrides)
    return KVTransferConfig(**values)


def hashes_for(num_full_blocks: int) -> list[int]:
    tokens = list(range(num_full_blocks * peer.SPEC.block_size))
    return block_hashes(tokens, peer.SPEC.block_size, seed=hash_seed("test-model"))


def wait_until(predicate, timeout: float = 10.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Decode:
    receiver: KVReceiver
    blocks: BlockManager
    pool: KVCachePool
    lock: threading.Lock = field(default_factory=threading.Lock)
    released: list = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.receiver.address

    def release(self, ids: list[int]) -> None:  # called from receiver threads
        with self.lock:
            self.released.append(list(ids))
            self.blocks.release_blocks(ids)

    def allocate(self, n: int) -> list[int]:
        with self.lock:
            return self.blocks.allocate_blocks(n)

    def free(self) -> int:
        with self.lock:
            return self.blocks.num_free_blocks

    def expect(self, request_id: str, ids: list[int], hashes: list[int], timeout: float = 10.0):
        return self.receiver.expect(request_id, ids, hashes, self.release, timeout=timeout)


def start_decode(config: KVTransferConfig, metrics=None, num_blocks: int = DECODE_BLOCKS) -> Decode:
    pool = KVCachePool(peer.SPEC, num_blocks)
    decode = Decode(KVReceiver(pool, config, metrics=metrics, worker_id="test-decode"),
                    BlockManager(num_blocks, peer.SPEC.block_size), pool)
    decode.receiver.start()
    return decode


def pytest_collection_modifyitems(items):
    # pool_io silences this torch warning with a module filter; pytest resets filters per test.
    for item in items:
        item.add_marker(pytest.mark.filterwarnings("ignore:The given buffer is not writable"))


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def decode(backend):
    d = start_decode(config_for(backend))
    yield d
    d.receiver.stop()


class SenderProcess:
    """A prefill-side process with its own source pool and a (fault-injectable) sender."""

    def __init__(self, backend: str, config: KVTransferConfig | None = None):
        self.conn, child_conn = CTX.Pipe()
        self.progress = CTX.Event()
        self.process = CTX.Process(target=peer.sender_main, daemon=True,
                                   args=(child_conn, backend, config or config_for(backend), self.progress))
        self.process.start()

    def start_push(self, **kwargs) -> None:
        self.progress.clear()
        self.conn.send(kwargs)

    def result(self, timeout: float = 60.0) -> dict:
        if not self.conn.poll(timeout):
            raise AssertionError(f"sender process gave no answer within {timeout}s")
        return self.conn.recv()

    def push(self, **kwargs) -> dict:
        self.start_push(**kwargs)
        return self.result()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


@pytest.fixture(scope="module")
def sender_processes():
    procs: dict[str, SenderProcess] = {}
    yield procs
    for p in procs.values():
        p.close()


@pytest.fixture
def sender(backend, sender_processes) -> SenderProcess:
    if backend not in sender_processes:
        sender_processes[backend] = SenderProcess(backend)
    return sender_processes[backend]
