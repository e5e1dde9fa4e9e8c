"""The "draft_model" method: a second, smaller model with the target's vocabulary proposes k
tokens autoregressively, from its own KV pool.

Each sequence's draft KV lives in blocks of the draft pool (engine/block_manager.py, no
prefix cache), keyed by the Sequence; the token ids whose KV is there are kept with it, so
validity is the common prefix with the sequence's tokens: rejected drafts are simply
recomputed over, a preempted or migrated sequence catches up with one chunk (on a
decode worker after a remote prefill, the draft model prefills the prompt itself: its KV
is rebuilt there, not transferred). Finished sequences' blocks go back after each step with
drafts (and before each proposal).

Drafts are drawn from q, the draft model's distribution under the request's own sampling
transforms (penalties, temperature, top-k/p, min-p; greedy: the argmax), with the very noise
the target's verification will draw at those positions: the sampler's exponential race
takes argmax(p / E) with E the request generator's next draw, so the draft for position i
is argmax(q / E_i) with E_i drawn ahead from a copy of that generator's state (the state is
put back). Verification is then verify.py's, unchanged: every emitted token is the token
sampling without speculation draws, so a seeded request gives the same tokens with and
without a draft model, and a migrated one resumes them (one draw per emitted token, as
engine._skip_draw replays). The price against Leviathan et al.'s rule with q: a draft is
kept when both races pick the same token (>= (1 - TV) / (1 + TV) of the time, not 1 - TV).
An unseeded sampled request gets its own generator (seeded from the engine's) the first
time it drafts, so the noise drawn ahead is the noise its verification draws.

Under tensor parallelism the draft model is not sharded: rank 0 loads it whole and runs it
alone (parallel/state.py `alone`), while the other ranks wait for the target's next step.
A draft model is small (its forward passes are latency, not FLOPs: sharding them would add
two all-reduces a layer to each), drafts only decide how many tokens a step may keep
(verification makes the tokens), and rank 0 alone proposes, so nothing needs the other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from splitserve.core.model_config import ModelConfig
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.logits_processors import apply_logits_processors
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.parallel.state import alone
from splitserve.engine.sampler import _filter_logits
from splitserve.engine.sequence import Sequence, SequenceStatus
from splitserve.engine.spec.verify import _with_tokens
from splitserve.engine.step_inputs import StepInputs


@dataclass
class _DraftKV:
    block_table: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # whose KV is in the draft pool, in order


class DraftModel:
    def __init__(self, config: EngineConfig, draft_dir: str, num_blocks: int, max_model_len: int,
                 eos_token_ids: set[int]):
        model_config = ModelConfig.from_dir(draft_dir)
        if model_config.rope.long_after is not None:
            raise ValueError(f"draft model {draft_dir}: longrope draft models are not supported")
        # one process, eager, unquantized: none of the target's execution features apply to it
        cfg = replace(config, model=draft_dir, num_kv_blocks=num_blocks, quantization=None, cuda_graphs=False,
                      async_scheduling=False, tensor_parallel_size=1, enable_expert_parallel=False,
                      enable_lora=False, lora_modules={},
                      speculative_config=None, model_id=None)
        with alone():  # (rank 0 of a tensor-parallel engine: whole, not its slice)
            self.runner = ModelRunner(model_config, cfg, max_model_len)
        self.blocks = BlockManager(self.runner.kv_pool.num_blocks, cfg.block_size, enable_prefix_caching=False)
        self.block_size = cfg.block_size
        self.eos_token_ids = eos_token_ids
        self.kv: dict[Sequence, _DraftKV] = {}

    def propose(self, seq: Sequence, k: int, generator: torch.Generator) -> list[int]:
        self.release_finished()
        kv = self.kv.setdefault(seq, _DraftKV())
        tokens = seq.token_ids
        valid = 0
        while valid < min(len(kv.tokens), len(tokens)) and kv.tokens[valid] == tokens[valid]:
            valid += 1
        valid = min(valid, len(tokens) - 1)  # the last token is run again: its logits are needed
        needed = -(-(len(tokens) + k - 1) // self.block_size) - len(kv.block_table)
        if needed > self.blocks.num_free_blocks:
            return []  # the draft pool is full: this step goes without drafts
        if needed > 0:
            kv.block_table += self.blocks.allocate_blocks(needed)
        logits = self._forward(kv.block_table, tokens[valid:], valid)
        kv.tokens = list(tokens)
        gen = None if seq.params.greedy else self._own_generator(seq, generator)
        ahead = gen.get_state() if gen is not None else None
        drafts: list[int] = []
        try:
            for i in range(k):
                q = self._distribution(logits, seq, drafts)
                token = int(q.argmax()) if gen is None else int(
                    (q / torch.empty_like(q).exponential_(generator=gen)).argmax())
                drafts.append(token)
                if i < k - 1:
                    logits = self._forward(kv.block_table, [token], len(tokens) + i)
                    kv.tokens.append(token)
        finally:
            if gen is not None:  # verification draws the same noise again
                gen.set_state(ahead)
        return drafts

    def _own_generator(self, seq: Sequence, engine_generator: torch.Generator) -> torch.Generator:
        if seq.generator is None:
            seed = int(torch.randint(2**62, (1,), generator=engine_generator, device=engine_generator.device))
            seq.generator = torch.Generator(device=engine_generator.device).manual_seed(seed)
        return seq.generator

    def _distribution(self, logits: torch.Tensor, seq: Sequence, drafts: list[int]) -> torch.Tensor:
        """q for the next draft: the request's sampling transforms on the draft's logits
        (greedy: the processed logits, whose argmax is the draft)."""
        processed = apply_logits_processors(logits, [_with_tokens(seq, drafts)], self.eos_token_ids)[0]
        p = seq.params
        if p.greedy:
            return processed
        return _filter_logits(processed / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)

    def _forward(self, table: list[int], token_ids: list[int], start: int) -> torch.Tensor:
        """Logits [1, vocab] after `token_ids` at positions start.. (one chunk of one sequence)."""
        n, bs = len(token_ids), self.block_size
        positions = list(range(start, start + n))
        step = StepInputs(input_ids=list(token_ids), positions=positions,
                          slots=[table[p // bs] * bs + p % bs for p in positions], logits_rows=[n - 1],
                          prefill_lens=[n], prefill_seq_lens=[start + n], prefill_block_tables=[list(table)],
                          decode_seq_lens=[], decode_block_tables=[], long_rope=None)
        with alone():
            return self.runner.execute(step).float()

    def release_finished(self) -> None:
        for seq in [s for s in self.kv if s.status == SequenceStatus.FINISHED]:
            self.blocks.release_blocks(self.kv.pop(seq).block_table)
