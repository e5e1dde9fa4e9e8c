"""Admission control: a bound on the requests one router has in flight, and on what
one request may ask for.

A request holds a slot from the moment it is routed until its response (or stream)
ends, so the bound counts requests queued at workers plus those decoding. Beyond it
the router answers 429 at once with `Retry-After`, instead of letting queues (and the
time to first token of everyone already admitted) grow without limit. Bad requests
are rejected before they take a slot.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from splitserve.core.sampling_params import SamplingParams
from splitserve.router import errors
from splitserve.router.errors import APIError

RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 30

# Per-request limits (documented in /openapi.json): one request must not cost unbounded
# router memory (n choices, stop strings checked per token) nor overflow the wire types.
MAX_CHOICES = 16
MAX_STOP_SEQUENCES = 16
MAX_STOP_TOKEN_IDS = 1024
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
INT64_MAX = 2**63 - 1


def n_limit_message(n) -> str:
    """The one message for an `n` out of range, whichever check finds it (the engine's own
    limit, 128, is wider than this server's)."""
    return f"'n' must be an integer in [1, {MAX_CHOICES}] on this server, got {n!r}"


def check_request_limits(params: SamplingParams) -> None:
    """400 for parameters that are valid OpenAI but beyond what this server takes."""
    if params.n > MAX_CHOICES:
        raise errors.invalid_request(n_limit_message(params.n), "n", "invalid_value")
    if len(params.stop) > MAX_STOP_SEQUENCES:
        raise errors.invalid_request(f"'stop' may hold at most {MAX_STOP_SEQUENCES} sequences, got "
                                     f"{len(params.stop)}", "stop", "invalid_value")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t > UINT32_MAX for t in params.stop_token_ids):
        raise errors.invalid_request(f"'stop_token_ids' must be at most {MAX_STOP_TOKEN_IDS} ids below 2**32",
                                     "stop_token_ids", "invalid_value")
    if params.top_k > INT32_MAX:
        raise errors.invalid_request(f"'top_k' must be below 2**31, got {params.top_k}", "top_k", "invalid_value")
    if params.seed is not None and not -(2**63) + MAX_CHOICES <= params.seed <= INT64_MAX - MAX_CHOICES:
        raise errors.invalid_request(f"'seed' must be a 64-bit integer (|seed| < 2**63 - {MAX_CHOICES})", "seed",
                                     "invalid_value")


@dataclass
class AdmissionConfig:
    max_queued_requests: int | None = None  # None: no bound
    request_timeout_s: float | None = None  # per-request deadline; None: none
    # With no healthy worker, how long a request waits for one to (re)register before 503: a
    # lone worker whose heartbeat was late under CPU starvation drops out of the registry for
    # a few seconds, and its clients should see latency then, not errors (issue 30).
    no_worker_wait_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be at least 1, got {self.max_queued_requests}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be a positive number of seconds, got {self.request_timeout_s}")
        if not self.no_worker_wait_s >= 0:
            raise ValueError(f"--no-worker-wait must be >= 0 seconds, got {self.no_worker_wait_s}")


class Overloaded(APIError):
    """429 in OpenAI's format; the server adds `headers` (Retry-After) to the response."""

    def __init__(self, request_id: str, in_flight: int, limit: int, retry_after: int):
        super().__init__(429, f"request {request_id}: this router already has {in_flight} requests in flight "
                         f"(--max-queued-requests {limit}); retry after {retry_after}s", "rate_limit_error",
                         code="too_many_requests_in_flight")
        self.headers = {"Retry-After": str(retry_after)}


def retry_after_seconds(recent_durations: list[float], in_flight: int, limit: int) -> int:
    """How long a rejected client should wait: a slot frees about every
    (typical request duration / requests in flight) seconds; ask for the time in which
    the excess would drain, within [1, 30] s."""
    if not recent_durations:
        return RETRY_AFTER_MIN_S
    typical = sorted(recent_durations)[len(recent_durations) // 2]
    excess = max(1, in_flight - limit + 1)
    estimate = typical * excess / max(1, in_flight)
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(estimate)))


class Admission:
    def __init__(self, config: AdmissionConfig):
        self.config = config
        self.in_flight = 0
        self.rejected = 0
        self.admitted = 0
        self._durations: deque[float] = deque(maxlen=128)

    def enter(self, request_id: str) -> float:
        """Take a slot (returns the start time to give back to leave()); APIError 429 when full."""
        limit = self.config.max_queued_requests
        if limit is not None and self.in_flight >= limit:
            self.rejected += 1
            wait = retry_after_seconds(list(self._durations), self.in_flight, limit)
            raise Overloaded(request_id, self.in_flight, limit, wait)
        self.in_flight += 1
        self.admitted += 1
        return time.monotonic()

    def leave(self, started: float) -> None:
        self.in_flight -= 1
        self._durations.append(time.monotonic() - started)

    def snapshot(self) -> dict:
        return {"in_flight": self.in_flight, "limit": self.config.max_queued_requests, "admitted": self.admitted,
                "rejected": self.rejected}
