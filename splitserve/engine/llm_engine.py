"""The engine loop: requests in, one scheduled forward pass per step, tokens out.

This is the incremental interface the workers drive (add_request / step / abort);
`LLM` in llm.py wraps it for offline batch generation.

Request intake (validation, sequence building) is mixed in from intake.py, as are
disaggregation, peer pulls and LoRA from their files; speculation and the overlapped
decode step (overlap.py) are called from the step.
"""

from __future__ import annotations

import math
import time
import weakref
from pathlib import Path

import torch

from splitserve.core.hashing import hash_seed
from splitserve.core.model_config import ModelConfig
from splitserve.core.tokenizer import Tokenizer
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.disaggregation import Disaggregation
from splitserve.engine.executor import build_executor
from splitserve.engine.grammar import GrammarCompiler
from splitserve.engine.intake import InvalidPromptError, RequestIntake  # noqa: F401 - re-exported: callers import it from here
from splitserve.engine.kv_offload.offloader import build_offloader
from splitserve.engine.lora.engine_setup import LoRAEngine, attach_lora
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.overlap import OverlappedDecode
from splitserve.engine.peer_prefix import PeerPrefix
from splitserve.engine.sampler import sample
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.sequence import Sequence
from splitserve.engine.spec.speculator import build_speculator
from splitserve.engine.spec.step import speculative_step
from splitserve.engine.stats import EngineStats
from splitserve.engine.token_output import TokenOutput
from splitserve.engine.warmup import warm_up


class LLMEngine(RequestIntake, Disaggregation, LoRAEngine, PeerPrefix):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer(config.model, self.model_config.eos_token_ids)
        self.max_model_len = min(config.max_model_len or math.inf, self.model_config.max_model_len)
        # the model in this process or over tensor-parallel ranks (engine/executor.py)
        self.executor = build_executor(config, self.model_config, int(self.max_model_len))
        weakref.finalize(self, self.executor.close)  # an engine dropped without close() ends its ranks
        self.offloader = None
        try:
            self._assemble(config)
        except BaseException:  # a failed start ends its ranks and offload writer now: a caller that
            self.close()  # keeps the exception keeps this object, and its TP group would block the process
            raise

    def _assemble(self, config: EngineConfig) -> None:
        """Everything around the loaded model: tiers, scheduler, grammars, speculation, LoRA."""
        self.runner = self.executor.runner
        self.model_id = config.model_id or Path(config.model).resolve().name
        # host / disk tiers, or None; under TP they copy every rank's heads of a block (kv_offload/device_blocks.py)
        offloading = config.kv_offload_bytes or config.kv_offload_dir
        self.offloader = build_offloader(config, self.executor.transfer_pool()) if offloading else None
        if self.offloader is not None:
            weakref.finalize(self, self.offloader.close)
        # hybrids: a recurrent-state slot per sequence (engine/recurrent_state.py), prefix caching off
        # (no state saved at block boundaries yet: engine/config.py turned it off with a logged line)
        state_slots = self.runner.state_pool.num_slots if self.runner.state_pool is not None else 0
        blocks = BlockManager(self.runner.kv_pool.num_blocks, config.block_size, hash_seed(self.model_id),
                              config.enable_prefix_caching, self.offloader, state_slots=state_slots)
        self.scheduler = Scheduler(blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.decoding_step_tokens)
        self.generator = torch.Generator(device=self.runner.device).manual_seed(config.seed)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        self.grammars = GrammarCompiler((Path(config.model) / "tokenizer.json").read_text(),
                                        self.model_config.vocab_size, sorted(self.eos_token_ids))
        self.long_rope_after = self.model_config.rope.long_after  # longrope: see engine/models/rope.py
        self.speculator = build_speculator(self) if config.speculative_config is not None else None
        self.sequences: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # finished, blocks kept for a KV push
        self.remote: dict[str, Sequence] = {}  # waiting for KV from a prefill worker
        # a sampled token into its sequence and a RequestOutput (engine/token_output.py)
        self.token_output = TokenOutput(self.scheduler, self.sequences, self.held, self.eos_token_ids,
                                        self.long_rope_after, config.delta_outputs)
        self.step_seconds = 0.0  # wall time in step() so far (with prompt_tokens_computed: the prefill rate)
        self.loras = attach_lora(self)  # None unless enable_lora (engine/lora/)
        self.overlap = OverlappedDecode(self) if config.async_scheduling else None
        if config.use_warm_up:
            warm_up(self)

    # ---- requests: engine/intake.py (RequestIntake) -------------------------------
    def abort(self, request_id: str, free_reservation: bool = True) -> bool:
        """End a request wherever it is. A remote prefill's reserved blocks are freed too,
        unless the caller frees them later (a KV write may still land in them)."""
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.scheduler.abort(request_id)
            return True
        if request_id in self.remote:
            if free_reservation:
                self.cancel_remote_prefill(request_id)
            return True
        return False

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every scheduled request with `error` (after a failed step); blocks are freed."""
        if self.overlap is not None:
            self.overlap.abandon()  # its tokens belong to the requests failed here
        outputs = []
        for rid in list(self.sequences):
            seq = self.sequences[rid]
            self.abort(rid)
            out = self.token_output.output(seq, [], [])
            out.error = error
            outputs.append(out)
        return outputs

    def stats(self, steps: int = 0) -> EngineStats:
        s = self.scheduler
        prefilling = [q for q in s.running if q.num_computed_tokens < q.num_tokens - 1]
        queued = sum(q.num_tokens - q.num_computed_tokens for q in s.waiting)
        queued += sum(q.num_tokens - q.num_computed_tokens for q in prefilling)
        return EngineStats(steps, len(s.waiting), len(s.running), len(prefilling), queued, len(self.remote),
                           len(self.held), len(self.sequences), s.num_free_blocks,
                           s.num_blocks, s.prefix_query_tokens, s.prefix_hit_tokens,
                           s.num_preemptions, sum(len(q.block_table) for q in self.held.values()),
                           s.prompt_tokens_computed, self.step_seconds, loras=self.lora_state(),
                           kv_offload=self.offloader.stats() if self.offloader is not None else None,
                           spec_decode=self.speculator.stats.snapshot() if self.speculator is not None else None,
                           overlapped_steps=self.overlap.steps if self.overlap is not None else 0,
                           expert_tokens=self.runner.expert_tokens.snapshot(),
                           free_state_slots=s.bm.state.num_free if s.bm.state is not None else 0,
                           total_state_slots=s.bm.state.num_slots if s.bm.state is not None else 0,
                           taken_at=time.time())

    # ---- the loop ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        try:
            return self._step()
        finally:
            self.step_seconds += time.perf_counter() - started

    def _step(self) -> list[RequestOutput]:
        self.executor.check_ranks()  # a tensor-parallel rank gone: said now, not blocked in a collective
        drained: list[RequestOutput] = []
        if self.overlap is not None:  # engine/overlap.py: a pure-decode step launched ahead, or
            launched = self.overlap.step()  # the outputs of the one in flight, then an ordinary step
            if launched is not None:
                return launched
            drained = self.overlap.drain()
        return drained + self._ordinary_step()

    def _ordinary_step(self) -> list[RequestOutput]:
        """Propose, schedule, execute, then sample or verify (docs/architecture.md, One engine step)."""
        if self.speculator is not None:  # drafts attached to the decodes about to be scheduled
            self.speculator.propose_drafts(self.scheduler)
        batch = self.scheduler.schedule()
        if not batch:
            return []
        due = [seq for seq, n in batch.entries
               if seq.num_computed_tokens + n == seq.num_tokens + len(seq.draft_token_ids)]
        plain = [seq for seq in due if not seq.draft_token_ids]  # (drafts: masked row by row in verify)
        masks = self.grammars.start_masks([seq.grammar for seq in plain])  # overlaps the forward pass
        # slots for the step's adapters, tokens grouped by slot (and the plan the other TP ranks follow)
        lora_plan = self.loras.prepare(batch.entries) if self.loras is not None else None
        mtp_rows = self.speculator.step_rows(batch) if self.speculator is not None else None
        try:
            logits, sampled = self.executor.run(batch, lora_plan)
        finally:
            mask = masks.result() if masks is not None else None
        assert sampled == due, "the runner sampled other sequences than the grammar masked"
        self.scheduler.computed(batch)
        if len(plain) < len(due):
            outputs = speculative_step(self, logits, sampled, mask)
        else:
            tokens, logprobs = sample(logits, sampled, self.generator, self.eos_token_ids, mask)
            append = self.token_output.append
            outputs = [append(seq, token, lp) for seq, token, lp in zip(sampled, tokens, logprobs, strict=True)]
        if mtp_rows is not None:  # the MTP layer reads the step's hidden states (engine/spec/mtp.py)
            self.speculator.ran(mtp_rows)
        return outputs

    # ---- introspection (tests, metrics, load reports) ---------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.scheduler.num_blocks

    def cached_block_hashes(self) -> list[int]:
        return self.scheduler.cached_block_hashes()

    def drain_block_events(self):
        """Prefix-cache changes since the last call (stored/removed/cleared), for the router."""
        return self.scheduler.drain_block_events()

    @property
    def kv_pool(self):
        """The KV cache tensors (a prefill worker's sender reads its held blocks from them);
        under TP every rank's heads as one pool, once share_kv_pool() ran."""
        return self.executor.kv_pool

    def share_kv_pool(self):
        """The KV pool in shared memory, for the worker's KV transfer: the pool itself at tp=1;
        under TP every rank's pool as one (parallel/kv_shards.py). Call it before steps run
        on another thread: under TP it is a broadcast to the ranks."""
        return self.executor.share_kv_pool()

    def close(self) -> None:
        """End the offload writer, then the other tensor-parallel ranks (nothing to do at tp=1):
        under TP the writer reads their pools (kv_offload/device_blocks.py)."""
        if self.offloader is not None:
            self.offloader.close()
        self.executor.close()
