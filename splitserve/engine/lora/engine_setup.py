"""How the engine takes LoRA on: the manager next to the model, the scheduler's admission
rule, and a request's adapter resolved by name (three small hooks in llm_engine.py)."""

from __future__ import annotations

from splitserve.engine.lora.adapter import LoRAAdapter, LoRAAdapterError
from splitserve.engine.lora.manager import LoRAManager, UnknownLoRAError


def attach_lora(engine) -> LoRAManager | None:
    """The engine's LoRAManager (None unless enable_lora), with --lora-modules loaded."""
    cfg = engine.config
    if not cfg.enable_lora:
        if cfg.lora_modules:
            raise ValueError("lora_modules needs enable_lora=True (--enable-lora)")
        return None
    manager = LoRAManager(engine.runner.model, cfg.max_loras, cfg.max_lora_rank, cfg.torch_dtype,
                          engine.runner.device)
    for name, path in cfg.lora_modules.items():
        manager.add(name, path)
    # a reserved remote prefill joins the batch later without admission: it counts as live
    engine.scheduler.admits = lambda seq: manager.admits(
        seq.lora, [*engine.scheduler.running, *engine.remote.values()])
    return manager


def resolve_lora(manager: LoRAManager | None, name: str | None) -> LoRAAdapter | None:
    if name is None:
        return None
    if manager is None:
        raise UnknownLoRAError(f"The model `{name}` does not exist (LoRA adapters are not enabled: --enable-lora).")
    return manager.resolve(name)


__all__ = ["LoRAAdapterError", "UnknownLoRAError", "attach_lora", "resolve_lora"]
