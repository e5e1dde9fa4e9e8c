"""A real prefill worker process whose KV sender misbehaves on request, for fault tests.

The fault is chosen per request by its sampling seed (FAULT_SEEDS; the tests' requests
are greedy, so a seed changes nothing else): `corrupt_once` flips a byte of the first
push's last chunk after it was encoded (corruption on the wire, after its checksums were
taken), `corrupt_always` of every push, `drop` leaves out one data chunk, `slow` waits
2 s before pushing (so a test can kill the process mid-request). Anything else is pushed
normally. The production classes are subclassed; nothing in splitserve knows about these
faults.

    python -m tests.reliability.faulty_prefill <splitserve prefill-worker flags>
"""

from __future__ import annotations

import sys
import time

from splitserve.kvtransfer import KVTransferConfig
from splitserve.kvtransfer.grpc_sender import GrpcSender
from splitserve.prefill_worker import main as prefill_main
from splitserve.prefill_worker.worker import PrefillWorker

FAULT_SEEDS = {"corrupt_once": 900001, "corrupt_always": 900002, "drop": 900003, "slow": 900004}
_FAULT_OF_SEED = {seed: fault for fault, seed in FAULT_SEEDS.items()}


class FaultyGrpcSender(GrpcSender):
    faults: dict[str, str] = {}  # request id -> fault, filled by the worker from the request's seed

    def push(self, request_id, *args, **kwargs):
        self.fault, self.corrupted = self.faults.pop(request_id, "normal"), 0
        if self.fault == "slow":
            time.sleep(2.0)
        return super().push(request_id, *args, **kwargs)

    def _frames(self, header, regions):
        encoded = list(super()._frames(header, regions))
        corrupt = self.fault == "corrupt_always" or (self.fault == "corrupt_once" and not self.corrupted)
        if corrupt:  # on the "wire": after the chunk's checksums were taken
            self.corrupted += 1
            last = bytearray(encoded[-1])
            last[len(last) // 2] ^= 0x5A  # the middle of a chunk is data (its checksums trail it)
            encoded[-1] = bytes(last)
        for i, frame in enumerate(encoded):
            if self.fault == "drop" and i == 1:  # frame 0 is the header: drop the first data chunk
                continue
            yield frame


class FaultyPrefillWorker(PrefillWorker):
    async def Prefill(self, request, context):  # noqa: N802 - gRPC name
        if request.sampling.has_seed and request.sampling.seed in _FAULT_OF_SEED:
            FaultyGrpcSender.faults[request.request_id] = _FAULT_OF_SEED[request.sampling.seed]
        return await super().Prefill(request, context)

    def _sender(self, backend: str):
        if backend not in self.senders:
            # Small chunks: a transfer has several, so one can go missing mid-stream.
            self.senders[backend] = FaultyGrpcSender(KVTransferConfig(backend="grpc", chunk_bytes=4096,
                                                                      security=self.config.security), self.metrics)
        return self.senders[backend]


if __name__ == "__main__":
    sys.exit(prefill_main.main(sys.argv[1:], worker_class=FaultyPrefillWorker))
