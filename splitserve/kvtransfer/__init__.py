"""KV cache transfer from prefill workers to decode workers.

Decode side: `KVReceiver(pool, config).start()`, then per request
`receiver.expect(request_id, dest_block_ids, block_hashes, release_blocks)` -> Future[TransferOutcome].
Prefill side: `create_sender(backend).push(request_id, receiver_address, src_pool,
src_block_ids, dest_block_ids, block_hashes)` -> PushResult (raises KVTransferError).
Backends: "grpc" (streamed chunks) and "mooncake" (one-sided writes). Protocol: docs/kv_transfer.md.
"""

from splitserve.kvtransfer.config import BACKENDS, KVTransferConfig
from splitserve.kvtransfer.outcome import KVTransferError, PushResult, TransferOutcome
from splitserve.kvtransfer.receiver import KVReceiver
from splitserve.kvtransfer.sender import KVSender, create_sender

__all__ = ["BACKENDS", "KVReceiver", "KVSender", "KVTransferConfig", "KVTransferError", "PushResult",
           "TransferOutcome", "create_sender"]
