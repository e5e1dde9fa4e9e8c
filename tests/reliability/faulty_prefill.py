"""A real prefill worker process whose KV sender misbehaves on request, for fault tests.

The fault is chosen per request by the prefix of its request id (the router passes the
client's X-Request-Id through): `corrupt_once-` flips a byte of the first push's last
chunk after it was encoded (corruption on the wire, after its checksums were taken),
`corrupt_always-` of every push, `drop-` leaves out one data chunk, `slow-` waits 2 s before pushing (so a test
can kill the process mid-request). Anything else is pushed normally. The production
classes are subclassed; nothing in splitserve knows about these faults.

    python -m tests.reliability.faulty_prefill <splitserve prefill-worker flags>
"""

from __future__ import annotations

import sys
import time

from splitserve.kvtransfer import KVTransferConfig
from splitserve.kvtransfer.grpc_sender import GrpcSender
from splitserve.prefill_worker import main as prefill_main
from splitserve.prefill_worker.worker import PrefillWorker

FAULTS = ("corrupt_once", "corrupt_always", "drop", "slow")


def fault_of(request_id: str) -> str:
    return next((f for f in FAULTS if request_id.startswith(f + "-")), "normal")


class FaultyGrpcSender(GrpcSender):
    def push(self, request_id, *args, **kwargs):
        self.fault, self.corrupted = fault_of(request_id), 0
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
    def _sender(self, backend: str):
        if backend not in self.senders:
            # Small chunks: a transfer has several, so one can go missing mid-stream.
            self.senders[backend] = FaultyGrpcSender(KVTransferConfig(backend="grpc", chunk_bytes=4096,
                                                                      tls=self.config.tls), self.metrics)
        return self.senders[backend]


if __name__ == "__main__":
    sys.exit(prefill_main.main(sys.argv[1:], worker_class=FaultyPrefillWorker))
