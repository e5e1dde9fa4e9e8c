"""Holding requests while decode is scaled to zero (opt-in: --hold-requests-at-zero N).

With no decode worker registered the model stays listed in /v1/models, and a request is
held instead of refused: at most N at a time, each for at most --hold-timeout seconds,
until a worker registers; then it is routed and streamed as any other. Beyond N, or
past the timeout, the client gets 503 with Retry-After in OpenAI's error format.

The operator scales decode up from zero on the held count, which it cannot see in any
worker's queue (there is none): the router publishes it on the cluster bus as a load
report of role decode under its own id (`router-held-...`), exactly where the
autoscaler reads the workers' queues. Routers route only to registered workers, so they
never mistake it for one. It is also exported as splitserve_router_held_requests.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

from splitserve.cluster.bus import ClusterBus
from splitserve.cluster.messages import LoadReport
from splitserve.router.errors import APIError
from splitserve.router.policy import NoHealthyWorker

log = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 1.0
REPORT_TTL_S = 5.0  # a router gone mid-hold stops counting within this


@dataclass(frozen=True)
class HoldConfig:
    max_held: int = 0  # requests held at once while no decode worker is registered; 0: off
    timeout_s: float = 300.0  # how long one request is held before 503
    retry_after_s: int = 30  # what a refused client is told: about a cold start

    def __post_init__(self) -> None:
        if self.max_held < 0:
            raise ValueError(f"--hold-requests-at-zero must be >= 0, got {self.max_held}")
        if not self.timeout_s > 0:
            raise ValueError(f"--hold-timeout must be a positive number of seconds, got {self.timeout_s}")

    @property
    def enabled(self) -> bool:
        return self.max_held > 0


class HeldAtZero(APIError):
    """503 in OpenAI's format; the server adds `headers` (Retry-After) to the response."""

    def __init__(self, message: str, code: str, retry_after: int):
        super().__init__(503, message, "service_unavailable", code=code)
        self.headers = {"Retry-After": str(retry_after)}


class RequestHolder:
    def __init__(self, config: HoldConfig, bus: ClusterBus, gauge=None):
        self.config = config
        self.bus = bus
        self.gauge = gauge  # splitserve_router_held_requests
        self.held = 0
        self.report_id = f"router-held-{uuid.uuid4().hex[:12]}"
        self._publisher: asyncio.Task | None = None

    async def hold(self, dispatcher, prompt: list[int], rid: str, deadline_s: float | None, lora: str | None = None):
        """The routing decision once a decode worker registers; HeldAtZero when full or past the
        hold timeout (or the request's own deadline, whichever is first)."""
        c = self.config
        if self.held >= c.max_held:
            raise HeldAtZero(f"request {rid}: no decode worker is running (scaled to zero) and this router already "
                             f"holds {self.held} requests for one (--hold-requests-at-zero {c.max_held}); retry after "
                             f"{c.retry_after_s}s", "held_at_zero_full", c.retry_after_s)
        wait = min(c.timeout_s, deadline_s or float("inf"))
        self._set(self.held + 1)
        log.warning("request %s: no decode worker (scaled to zero?); holding it up to %.0f s for one to register "
                    "(%d held)", rid, wait, self.held)
        try:
            return await dispatcher.decide_waiting(prompt, wait, lora=lora)
        except NoHealthyWorker:
            raise HeldAtZero(f"request {rid}: held {wait:.0f}s (--hold-timeout) and no decode worker registered; "
                             f"the deployment is starting from zero: retry after {c.retry_after_s}s",
                             "no_workers_at_zero", c.retry_after_s) from None
        finally:
            self._set(self.held - 1)

    def _set(self, held: int) -> None:
        self.held = held
        if self.gauge is not None:
            self.gauge.set(held)
        if held and (self._publisher is None or self._publisher.done()):
            self._publisher = asyncio.get_running_loop().create_task(self._publish())

    async def _publish(self) -> None:
        """The held count on the bus every second while any is held, then one final 0."""
        while True:
            held = self.held
            try:
                await self.bus.publish_load(LoadReport(self.report_id, "decode", waiting=held, running=0,
                                                       kv_usage=0.0), REPORT_TTL_S)
            except Exception as exc:  # noqa: BLE001 - the bus may be down; holding goes on regardless
                log.warning("could not publish the held-request count on the bus: %s", exc)
            if held == 0:
                return
            await asyncio.sleep(PUBLISH_INTERVAL_S)

    async def close(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
            await asyncio.gather(self._publisher, return_exceptions=True)
