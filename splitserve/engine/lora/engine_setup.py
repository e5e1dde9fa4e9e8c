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
    for name, path in cfg.lora_modules.items():  # (a failure ends the start: LLMEngine closes its ranks)
        manager.add(name, path)
    # a reserved remote prefill joins the batch later without admission: it counts as live
    engine.scheduler.admits = lambda seq: manager.admits(
        seq.lora, [*engine.scheduler.running, *engine.remote.values()])
    return manager


def resolve_lora(manager: LoRAManager | None, name: str | None) -> LoRAAdapter | None:
    """The adapter a request names; an unknown one is a bad request (UnknownModelError, an
    InvalidPromptError: workers answer NOT_FOUND, never "this worker failed")."""
    from splitserve.engine.intake import UnknownModelError  # (intake imports this module)

    if name is None:
        return None
    if manager is None:
        raise UnknownModelError(f"The model `{name}` does not exist (LoRA adapters are not enabled: --enable-lora).")
    try:
        return manager.resolve(name)
    except UnknownLoRAError as exc:
        raise UnknownModelError(str(exc)) from None


class LoRAEngine:
    """LLMEngine's LoRA calls (workers reach them through AsyncEngine / EngineProcess)."""

    loras: LoRAManager | None

    def add_lora(self, name: str, path: str) -> int:
        """Load an adapter at runtime; its block-hash salt (raises LoRAAdapterError)."""
        if self.loras is None:
            raise LoRAAdapterError("LoRA adapters are not enabled on this worker (--enable-lora)")
        return self.loras.add(name, path).salt

    def remove_lora(self, name: str) -> bool:
        return self.loras is not None and self.loras.remove(name)

    def lora_state(self) -> tuple[tuple[str, int, bool, int], ...]:
        """(name, salt, holds a slot now, times swapped in) of every loaded adapter (load
        reports, metrics)."""
        if self.loras is None:
            return ()
        resident, loads = set(self.loras.resident()), self.loras.slots.loads
        return tuple((n, a.salt, n in resident, loads[a.key]) for n, a in self.loras.adapters.items())


__all__ = ["LoRAAdapterError", "LoRAEngine", "UnknownLoRAError", "attach_lora", "resolve_lora"]
