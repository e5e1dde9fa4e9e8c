"""Overlapped decode steps (`--async-scheduling`, vLLM's name for it; issue 37).

A synchronous decode step leaves the GPU idle while the host reads the sampled tokens,
checks stops, builds outputs, schedules and stages the next step: at batch 256 on an H100
that host time was larger than the step itself. Here a pure-decode step is launched
before the previous one's tokens reach the host:

  launch N: its inputs staged with each sequence's last token as a *placeholder*
            -(j + 1), "row j of the previous step's sampled tokens", which the padded
            step reads from a device buffer (cuda_graphs.DecodeGraphs.previous_tokens);
            sampled on the device, copied into that buffer and (asynchronously) to the host
  then:     step N-1's tokens read (its copy is long done), placeholders replaced, stop
            checks and outputs as usual (`TokenOutput.took`), its full blocks published
  then:     N's sequences count the token in flight (computed + 1, a new placeholder:
            `Scheduler.launched_ahead`)

So each step's outputs arrive one step late, and a sequence that finished with step N-1's
token still ran in step N: its row is ignored (as vLLM does). Tokens are those of the
synchronous engine: the same padded step, the same sampler (`sampler.draw`), the same
per-request generators (a finished row's extra draw only touches its own generator).

The scheduler makes the step in a mode of its own (`Scheduler.schedule_ahead`, with
`launched_ahead` and `landed` for the placeholders): its ordinary `schedule`, called only when
that is certain to be a decode of every running sequence with a bucket and free blocks for all
(no waiting request, no preemption), leaving out a sequence certain to finish with its token
in flight (max_tokens, the context). This module adds only what needs the host between two
tokens, which cannot overlap: a grammar, penalties (they read the tokens so far), drafts,
held KV or a longrope switch. LoRA overlaps: a decode step's tokens grouped by adapter
depend only on which sequences run, the same as the step in flight's (its grouping is kept,
apply.py), unless an adapter would have to be swapped into a slot (then it drains). n-gram
speculation overlaps the steps that would have no drafts: a sequence whose known tail
recurs (the lookup the next step would make, less the token in flight) drains, and the
ordinary step proposes and verifies its drafts with every token on the host
(Speculator.drafts_ahead); an overlapped step proposes none (its last token is in flight).
Under tensor parallelism the staged step and the previous step's tokens are broadcast to the
other ranks before it runs (parallel/padded_decode.py). Logit bias and min_tokens apply as
in the synchronous step (min_tokens counts the token in flight); logprobs are computed on
the device with the token and read with it. Anything else drains first: the step in
flight is finished, then the ordinary step runs. A block is published only after the step
that wrote its last slot has completed (it may then be shared or written down).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from splitserve.engine.logits_processors import apply_logits_processors
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampler import device_logprobs, draw, host_logprobs
from splitserve.engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    seqs: list[Sequence]  # the step's rows, in order
    host: torch.Tensor  # their sampled tokens, arriving on the host
    ready: torch.cuda.Event | None  # recorded after the copy (None on the CPU: already there)
    logprobs: list  # per row, sampler.device_logprobs' tensors or None


class OverlappedDecode:
    def __init__(self, engine):
        if engine.long_rope_after is not None:
            raise ValueError("async_scheduling is not supported for longrope models (a sequence passing the "
                             "original length is recomputed, which needs its tokens on the host)")
        if engine.runner.device.type != "cuda":
            log.warning("--async-scheduling on %s: the forward pass runs on this thread, so nothing overlaps; "
                        "decode steps take the padded static-buffer path (for tests; leave it off here)",
                        engine.runner.device)
        self.engine = engine
        self.graphs = engine.runner.decode_graphs
        self.in_flight: InFlight | None = None
        self.steps = 0  # overlapped steps launched (tests, the step-overhead bench)
        size = self.graphs.buckets[-1]
        pin = engine.runner.device.type == "cuda"
        self._host = [torch.zeros(size, dtype=torch.int64, pin_memory=pin) for _ in range(2)]  # alternating

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput] | None:
        """Launch the next decode step ahead and return the previous one's outputs, or
        None when this step cannot overlap (the caller drains, then runs it ordinarily)."""
        scheduler = self.engine.scheduler
        batch = scheduler.schedule_ahead(self._eligible, self.graphs.buckets[-1], self.graphs.width)
        if batch is None:
            return None
        lora_plan = None  # (the plan: what the other tensor-parallel ranks put in their slots)
        if self.engine.loras is not None:  # the same sequences as the step in flight: its grouping, kept
            lora_plan = self.engine.loras.prepare(batch.entries)
        launched = self._launch(batch.decodes, lora_plan)
        outputs = self._finish(self.in_flight)
        scheduler.launched_ahead(batch)
        self.in_flight = launched
        self.steps += 1
        return outputs

    def drain(self) -> list[RequestOutput]:
        """The outputs of the step in flight, if any; afterwards every token is on the host."""
        outputs = self._finish(self.in_flight)
        self.in_flight = None
        return outputs

    def abandon(self) -> None:
        """A failed step: the tokens in flight are void; their placeholders leave the
        sequences (whose requests are failed next), so no output carries one."""
        if self.in_flight is not None:
            for seq in self.in_flight.seqs:
                if seq.token_ids and seq.token_ids[-1] < 0:
                    seq.token_ids.pop()
            self.in_flight = None

    def _eligible(self, seq: Sequence) -> bool:
        """`seq` may run in an overlapped step: nothing between its tokens needs the host, its
        adapter is in a slot already (no swap) and speculation would give it no drafts."""
        e = self.engine
        return (_overlappable(seq) and (e.loras is None or e.loras.holds_slot(seq.lora))
                and (e.speculator is None or not e.speculator.drafts_ahead(seq, len(e.scheduler.running))))

    # ---- parts ------------------------------------------------------------------------
    def _launch(self, seqs: list[Sequence], lora_plan=None) -> InFlight:
        graphs, n = self.graphs, len(seqs)
        with torch.inference_mode():
            logits = self.engine.executor.run_padded(seqs, lora_plan)[:n]  # (under TP: the other ranks too)
            # logit bias and min_tokens read no token (min_tokens counts them, the one in flight included)
            processed = apply_logits_processors(logits, seqs, self.engine.eos_token_ids)
            tokens = draw(processed, seqs, self.engine.generator)
            logprobs = device_logprobs(logits, tokens, seqs)  # (the logits are the graph's: read them now)
            graphs.previous_tokens[:n].copy_(tokens)  # the next step's placeholders read these
            host = self._host[self.steps % 2]
            host[:n].copy_(tokens, non_blocking=True)
        ready = None
        if tokens.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return InFlight(list(seqs), host, ready, logprobs)

    def _finish(self, flight: InFlight | None) -> list[RequestOutput]:
        """Step `flight`'s tokens replace its placeholders and go through the usual
        per-token path; a row whose request ended meanwhile (a stop, an abort) is skipped."""
        if flight is None:
            return []
        self.in_flight = None
        if flight.ready is not None:
            flight.ready.synchronize()
        e = self.engine
        tokens = flight.host[: len(flight.seqs)].tolist()
        outputs = []
        for seq, token, part in zip(flight.seqs, tokens, flight.logprobs, strict=True):
            if seq.is_finished or e.sequences.get(seq.request_id) is not seq:
                continue
            e.scheduler.landed(seq, token)  # (its blocks' KV is written: the step completed)
            outputs.append(e.token_output.took(seq, token, host_logprobs(part, token)))
        return outputs


def _overlappable(seq: Sequence) -> bool:
    """Nothing between two of its tokens needs the host (module docstring)."""
    p = seq.params
    penalties = p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0  # (read the tokens)
    return seq.grammar is None and not penalties and not seq.draft_token_ids and not seq.hold_kv

