"""How a transfer ended, as the decode worker (TransferOutcome) and the prefill
worker (PushResult / KVTransferError) see it."""

from __future__ import annotations

from dataclasses import dataclass

# Reasons a receiver-side lease ends; also the `reason` label of
# splitserve_kv_transfer_errors_total.
OK = "ok"
CHECKSUM_MISMATCH = "checksum_mismatch"
TIMEOUT = "timeout"
SENDER_LOST = "sender_lost"
ABORTED = "aborted"
BAD_HEADER = "bad_header"
BAD_STREAM = "bad_stream"
RECEIVER_STOPPED = "receiver_stopped"


@dataclass(frozen=True)
class TransferOutcome:
    """Result of a receiver's expect(): ok means every block arrived and matched its
    checksum, and the blocks now belong to the request. Otherwise the receiver has
    released (or will release, once no write can still land) the leased blocks."""

    request_id: str
    ok: bool
    reason: str
    detail: str = ""
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class PushResult:
    request_id: str
    receiver: str
    nbytes: int
    seconds: float
    attempts: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class KVTransferError(RuntimeError):
    """A push that did not deliver. `reason` is machine-readable (a PushStatus name in
    lower case, or deadline / unavailable / receiver_busy / rpc_error / write_failed /
    layout_mismatch); the message names the request, the receiver and what to check."""

    def __init__(self, request_id: str, receiver: str, reason: str, detail: str):
        self.request_id = request_id
        self.receiver = receiver
        self.reason = reason
        self.detail = detail
        super().__init__(f"KV transfer of request {request_id!r} to {receiver} failed ({reason}): {detail}")
