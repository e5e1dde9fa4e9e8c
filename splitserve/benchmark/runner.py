"""Drives one benchmark run: releases sessions on the arrival schedule, caps the
requests in flight, runs each session's turns in order, and keeps every result.

As in vLLM, a request's clock starts when it is actually sent, after waiting for a
--max-concurrency slot: TTFT measures the server, not the client's queue. Sessions
are released on an absolute schedule (start + offset), so a slow event loop does not
stretch the gaps and lower the offered rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from splitserve.benchmark.arrivals import arrival_offsets
from splitserve.benchmark.client import ClientConfig, make_session, send_request
from splitserve.benchmark.request import RequestResult, Session, Turn
from splitserve.benchmark.workloads import total_requests


@dataclass
class RunConfig:
    request_rate: float = math.inf  # sessions released per second
    burstiness: float = 1.0
    arrival: str = "poisson"
    max_concurrency: int | None = None  # requests in flight; None: unlimited
    seed: int = 0
    progress: bool = True
    # Sent in X-Request-Id before each request id, so that ids stay unique across runs
    # and concurrent bench processes (servers may key requests on that header) and an
    # error line can be grepped in the server's logs. None: a random "bench-<hex>-".
    id_prefix: str | None = None


@dataclass
class RunOutcome:
    request_rate: float
    results: list[RequestResult]  # in session order, turns in order
    duration_s: float  # first release to last completion


def conversation_prompt(history: list[tuple[list[int] | str, str]], turn: Turn, chat: bool,
                        conversational: bool) -> tuple[list[int] | str | list[dict[str, str]], int]:
    """The prompt for `turn` after the (user, answer) pairs of `history`, and our
    token estimate for it. For completions, a conversation is a transcript in which
    each turn's prompt is exactly the previous prompt + its answer + the new message,
    so prefix caches can reuse it."""
    estimate = turn.prompt_len + sum(
        (len(u) if isinstance(u, list) else len(u.split())) + len(a.split()) for u, a in history)
    if chat:
        if not isinstance(turn.prompt, str):
            raise TypeError("chat requests need text prompts, not token ids")
        messages: list[dict[str, str]] = []
        for user, answer in history:
            messages += [{"role": "user", "content": str(user)},
                         {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": turn.prompt})
        return messages, estimate
    if not conversational:
        return turn.prompt, estimate
    transcript = "".join(f"User: {u}\nAssistant:{a}\n" for u, a in history)
    return f"{transcript}User: {turn.prompt}\nAssistant:", estimate


async def _run_session(http: aiohttp.ClientSession, cfg: ClientConfig, session: Session,
                       slots: asyncio.Semaphore | None, pbar: tqdm, bench_start: float,
                       id_prefix: str) -> list[RequestResult]:
    history: list[tuple[list[int] | str, str]] = []
    out: list[RequestResult] = []
    conversational = len(session.turns) > 1
    for k, turn in enumerate(session.turns):
        prompt, estimate = conversation_prompt(history, turn, cfg.is_chat, conversational)
        async with slots or contextlib.nullcontext():
            result = await send_request(http, cfg, id_prefix + turn.request_id, prompt,
                                        turn.max_tokens, estimate)
        result.send_offset = result.start - bench_start
        out.append(result)
        pbar.update(1)
        if not result.success:
            # Later turns would need this answer: they are counted as failed, not sent.
            for rest in session.turns[k + 1:]:
                out.append(RequestResult(id_prefix + rest.request_id, error=(
                    f"not sent: turn {result.request_id} of session {session.session_id} failed")))
                pbar.update(1)
            break
        history.append((turn.prompt, result.generated_text))
    return out


async def run_benchmark(sessions: list[Session], client_cfg: ClientConfig,
                        run_cfg: RunConfig) -> RunOutcome:
    offsets = arrival_offsets(len(sessions), run_cfg.request_rate, run_cfg.burstiness,
                              run_cfg.arrival, run_cfg.seed)
    id_prefix = run_cfg.id_prefix
    if id_prefix is None:
        id_prefix = f"bench-{secrets.token_hex(3)}-"
    slots = asyncio.Semaphore(run_cfg.max_concurrency) if run_cfg.max_concurrency else None
    pbar = tqdm(total=total_requests(sessions), disable=not run_cfg.progress, unit="req",
                desc=f"rate {run_cfg.request_rate:g}", dynamic_ncols=True)
    try:
        async with make_session(client_cfg) as http:
            start = time.perf_counter()
            tasks = []
            for session, offset in zip(sessions, offsets, strict=True):
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(
                    _run_session(http, client_cfg, session, slots, pbar, start, id_prefix)))
            per_session = await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
    finally:
        pbar.close()
    results = [r for session_results in per_session for r in session_results]
    return RunOutcome(run_cfg.request_rate, results, duration)
