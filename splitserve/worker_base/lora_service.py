"""LoadLoRA / UnloadLoRA: the gRPC calls the router makes on every decode and prefill
worker for runtime adapters (/v1/load_lora_adapter). A bad adapter is INVALID_ARGUMENT
with the engine's one-line reason; the worker's adapters are then unchanged. Anything
else is INTERNAL with a fixed message: the reason goes to this worker's log in one line,
never to the caller (whose client would see it)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from splitserve.engine.lora.adapter import LoRAAdapterError
from splitserve.proto.convert import pb

log = logging.getLogger(__name__)


class LoRAService:
    """Mixed into DecodeWorker and PrefillWorker (which have `engine` and `worker_id`)."""

    async def LoadLoRA(self, request: pb.LoRAAdapterRequest, context) -> pb.LoRAAdapterReply:  # noqa: N802
        try:
            salt = await self.engine.add_lora(request.lora_name, request.lora_path)
        except LoRAAdapterError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.worker_id}: {exc}")
        except Exception as exc:  # noqa: BLE001 - e.g. the engine died: one line here, nothing internal there
            await self._internal(context, "loading", request.lora_name, exc)
        await self._stats_show(request.lora_name, loaded=True)
        return pb.LoRAAdapterReply(salt=salt)

    async def UnloadLoRA(self, request: pb.LoRAAdapterRequest, context) -> pb.LoRAAdapterReply:  # noqa: N802
        try:
            found = await self.engine.remove_lora(request.lora_name)
        except Exception as exc:  # noqa: BLE001
            await self._internal(context, "unloading", request.lora_name, exc)
        await self._stats_show(request.lora_name, loaded=False)
        return pb.LoRAAdapterReply(found=found)

    async def _internal(self, context, doing: str, name: str, exc: Exception) -> None:
        # %r: a name from the wire cannot split the log line
        log.error("worker %s: %s LoRA adapter %r failed: %s: %s", self.worker_id, doing, name[:256],
                  type(exc).__name__, str(exc).replace("\n", " ")[:500])
        await context.abort(grpc.StatusCode.INTERNAL, f"{self.worker_id}: {doing} the adapter failed (see its log)")

    async def _stats_show(self, name: str, loaded: bool, timeout_s: float = 5.0) -> None:
        """Reply once the engine's stats (what load reports are built from) show the change:
        the router patches its copy of this worker's report when we reply, and a heartbeat
        built from older stats would undo that."""
        deadline = time.monotonic() + timeout_s
        while any(a[0] == name for a in self.stats.loras) != loaded and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
