"""LoadLoRA / UnloadLoRA: the gRPC calls the router makes on every decode and prefill
worker for runtime adapters (/v1/load_lora_adapter). A bad adapter is INVALID_ARGUMENT
with the engine's one-line reason; the worker's adapters are then unchanged."""

from __future__ import annotations

import grpc

from splitserve.engine.lora.adapter import LoRAAdapterError
from splitserve.proto.convert import pb


class LoRAService:
    """Mixed into DecodeWorker and PrefillWorker (which have `engine` and `worker_id`)."""

    async def LoadLoRA(self, request: pb.LoRAAdapterRequest, context) -> pb.LoRAAdapterReply:  # noqa: N802
        try:
            salt = await self.engine.add_lora(request.lora_name, request.lora_path)
        except LoRAAdapterError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.worker_id}: {exc}")
        return pb.LoRAAdapterReply(salt=salt)

    async def UnloadLoRA(self, request: pb.LoRAAdapterRequest, context) -> pb.LoRAAdapterReply:  # noqa: N802
        return pb.LoRAAdapterReply(found=await self.engine.remove_lora(request.lora_name))
