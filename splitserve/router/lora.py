"""LoRA adapters as the router sees them: the names requests may give as `model`, each
adapter's block-hash salt (so the router's prefix index keys KV by adapter exactly as the
workers do), and runtime loading fanned out to every worker.

The workers are the source of truth: their load reports list the adapters they have loaded
(name -> salt, the salt from the adapter's content). The router keeps each registered
worker's last listed adapters even while its report has expired (a worker too busy to
report on time still has them). A runtime load or unload through the router is applied to
every live decode and prefill worker, all or nothing, and recorded here at once, so the next
request sees it without waiting for a report. A worker that registers later has only its
--lora-modules. An adapter being unloaded is no longer served from the moment the unload
starts (requests naming it get 404 model_not_found up front, not a worker's refusal), and a
name has one change in flight at a time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import grpc

from splitserve.core.hashing import hash_seed
from splitserve.core.lora_names import lora_name_problem
from splitserve.proto.convert import pb
from splitserve.proto.worker_pb2_grpc import DecodeWorkerStub, PrefillWorkerStub
from splitserve.router import errors
from splitserve.router.errors import APIError

log = logging.getLogger(__name__)

RUNTIME_ENV = "SPLITSERVE_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
PENDING_S = 30.0  # how long a runtime change outlives reports that do not show it
FIRST_REPORT_WAIT_S = 2.0  # how long a request waits for a newly registered worker's first load report


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true")


class RouterLoRA:
    def __init__(self, sync, security, served: str):
        self.sync, self.security, self.served = sync, security, served
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._known: dict[str, dict[str, int]] = {}  # worker -> its adapters (name -> salt)
        self._seen: dict[str, object] = {}  # worker -> the report _known was last taken from
        # worker -> runtime changes its reports have not shown yet: name -> (salt, or None when
        # unloaded; when). A report built just before the change must not undo it.
        self._pending: dict[str, dict[str, tuple[int | None, float]]] = {}
        self._busy: set[str] = set()  # names with a load or unload in flight
        self._unloading: set[str] = set()  # ... of which unloads: served no more

    # ---- what is served -------------------------------------------------------------------
    def worker_loras(self) -> dict[str, dict[str, int]]:
        """Each registered worker's adapters, from its latest report."""
        for w, report in self.sync.loads.items():
            if self._seen.get(w) is not report:
                self._seen[w], self._known[w] = report, dict(report.loras)
                self._apply_pending(w)
        for w in [w for w in self._known if w not in self.sync.workers]:
            self._known.pop(w), self._seen.pop(w, None), self._pending.pop(w, None)
        return self._known

    def _apply_pending(self, w: str) -> None:
        """A runtime change stays applied over `w`'s reports until one shows it (or a while
        has passed: the worker restarted without it, say)."""
        known, pending = self._known[w], self._pending.get(w, {})
        for name, (salt, since) in list(pending.items()):
            if (name in known) == (salt is not None) or time.monotonic() - since > PENDING_S:
                del pending[name]
            elif salt is None:
                known.pop(name, None)
            else:
                known[name] = salt

    def _record(self, w: str, name: str, salt: int | None) -> None:
        known = self.worker_loras().setdefault(w, {})
        if salt is None:
            known.pop(name, None)
        else:
            known[name] = salt
        self._pending.setdefault(w, {})[name] = (salt, time.monotonic())

    def adapters(self) -> dict[str, int]:
        """name -> salt of every adapter a live decode worker has loaded."""
        known, out = self.worker_loras(), {}
        for w in self.sync.live("decode"):
            out.update(known.get(w, {}))
        for name in self._unloading:
            out.pop(name, None)
        return out

    def have(self, workers: list[str], lora: str) -> list[str]:
        """Those of `workers` that have `lora` loaded."""
        known = self.worker_loras()
        return [w for w in workers if lora in known.get(w, {}) and lora not in self._unloading]

    def models(self) -> list[str]:
        return [self.served, *sorted(self.adapters())]

    async def judged(self, parse):
        """await parse(models()): a request read against the served models. If it names none of
        them while a decode worker that registered a moment ago has not reported yet (the
        report lists its adapters), read it again once that report is in."""
        try:
            return await parse(self.models())
        except APIError as exc:
            if exc.code != "model_not_found" or not await self.first_reports_arrived():
                raise
        return await parse(self.models())

    async def first_reports_arrived(self, wait_s: float = FIRST_REPORT_WAIT_S) -> bool:
        """Wait (at most `wait_s`) for the first load report of every live decode worker that has
        sent none yet: registration and the first report travel apart, and the report is what
        lists the worker's adapters. True when there was such a worker (models() may have
        changed), False at once otherwise."""
        deadline = time.monotonic() + wait_s
        waited = False
        while any(w not in self.sync.loads for w in self.sync.live("decode")) and time.monotonic() < deadline:
            waited = True
            await asyncio.sleep(0.05)
        return waited

    def salt(self, name: str | None) -> int:
        """What `name` mixes into block hashes, as its workers compute it (0: the base model).
        An adapter no report lists yet gets a salt of its name: never the base model's blocks."""
        if name is None:
            return 0
        return self.adapters().get(name) or hash_seed("lora:" + name)

    def lora_name(self, model: str) -> str | None:
        """The adapter a request's `model` names (None: the base model)."""
        return None if model == self.served else model

    def model_objects(self, created: int) -> list[dict]:
        """/v1/models entries of the adapters, vLLM's shape (`parent`: the base model)."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "splitserve", "root": name,
                 "parent": self.served} for name in sorted(self.adapters())]

    # ---- runtime load / unload ----------------------------------------------------------------
    def _workers(self) -> list[tuple[str, object]]:
        stubs = []
        for role, stub_class in (("decode", DecodeWorkerStub), ("prefill", PrefillWorkerStub)):
            for w in self.sync.live(role):
                address = self.sync.workers[w].info.address
                if address not in self._channels:
                    self._channels[address] = self.security.aio_channel(address, [])
                stubs.append((w, stub_class(self._channels[address])))
        return stubs

    def _claim(self, name: str) -> None:
        if name in self._busy:
            raise APIError(409, f"LoRA adapter '{name}' is being loaded or unloaded; retry when that has finished",
                           "invalid_request_error", "lora_name", "lora_busy")
        self._busy.add(name)

    async def load(self, name: str, path: str) -> None:
        """Load on every live worker; if any refuses, unload it where it loaded (nothing
        changes) and raise the refusal as a 400."""
        if name == self.served or name in self.adapters():
            raise errors.invalid_request(f"The model '{name}' is already loaded (unload it first)", "lora_name")
        self._claim(name)
        try:
            await self._load(name, path)
        finally:
            self._busy.discard(name)

    async def _load(self, name: str, path: str) -> None:
        workers = self._workers()
        if not workers:
            raise APIError(503, "no live worker to load the adapter on; retry shortly", "service_unavailable",
                           code="no_workers")
        request = pb.LoRAAdapterRequest(lora_name=name, lora_path=path)
        results = await asyncio.gather(*(stub.LoadLoRA(request, timeout=120, metadata=self.security.metadata)
                                         for _, stub in workers), return_exceptions=True)
        failed = [(w, r) for (w, _), r in zip(workers, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            await self._unload([(w, s) for (w, s), r in zip(workers, results, strict=True)
                                if not isinstance(r, BaseException)], name)
            worker, exc = next(((w, e) for w, e in failed if _refused(e)), failed[0])
            if _refused(exc):  # the adapter is bad: the worker's one-line reason, without its id
                raise errors.invalid_request(exc.details().partition(": ")[2] or exc.details(), "lora_path")
            # anything else is ours, not the client's: the details go to the log (one line), never the body
            log.error("LoRA adapter %r: worker %s did not load it (%s); unloaded everywhere again", name, worker,
                      _one_line(exc))
            raise APIError(503, f"worker {worker} could not load LoRA adapter '{name}'; nothing was loaded",
                           "service_unavailable", code="worker_failure")
        for (w, _), reply in zip(workers, results, strict=True):
            self._record(w, name, reply.salt)

    async def unload(self, name: str) -> None:
        if name not in self.adapters():
            raise errors.model_not_found(name, self.models())
        self._claim(name)
        self._unloading.add(name)  # from now on requests naming it get 404, before any worker refuses them
        try:
            await self._unload(self._workers(), name)
        finally:
            self._unloading.discard(name)
            self._busy.discard(name)

    async def _unload(self, workers, name: str) -> None:
        request = pb.LoRAAdapterRequest(lora_name=name)
        results = await asyncio.gather(*(stub.UnloadLoRA(request, timeout=30, metadata=self.security.metadata)
                                         for _, stub in workers), return_exceptions=True)
        for (w, _), r in zip(workers, results, strict=True):
            if isinstance(r, BaseException):  # its next report says whether it still has it
                log.warning("LoRA adapter %r: worker %s did not confirm the unload (%s)", name, w, _one_line(r))
            self._record(w, name, None)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()


def _refused(exc: BaseException) -> bool:
    """A worker's "this adapter is bad" (its reason is for the client), not a failure of its own."""
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}".replace("\n", " ")[:300]
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]


def lora_candidates(workers: list[str], having: list[str], loads: dict, lora: str | None,
                    slack: int = 4) -> list[str]:
    """The workers a request under `lora` may go to: those `having` it loaded (all of
    `workers` if none is known to yet); among them those with it in a slot already (their
    load reports, `loads`: no swap, no other adapter evicted), unless even the least busy of
    those has `slack` more requests than the least busy of the rest: a hot adapter then
    spreads to another worker instead of queueing behind one."""
    if lora is None:
        return workers
    loaded = [w for w in workers if w in having] or workers
    resident = [w for w in loaded if w in loads and lora in loads[w].resident_loras]
    if not resident or len(resident) == len(loaded):
        return loaded

    def busy(w: str) -> int:
        return loads[w].running + loads[w].waiting if w in loads else 0

    others = min(busy(w) for w in loaded if w not in resident)
    return resident if min(busy(w) for w in resident) <= others + slack else loaded


def parse_lora_body(raw: bytes, need_path: bool) -> tuple[str, str]:
    """(lora_name, lora_path) of a load / unload body, vLLM's fields; 400 in one line otherwise."""
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError):
        raise errors.invalid_request("the body must be a JSON object with lora_name (and lora_path)") from None
    if not isinstance(body, dict):
        raise errors.invalid_request("the body must be a JSON object with lora_name (and lora_path)")
    fields = ("lora_name", "lora_path") if need_path else ("lora_name",)
    for f in fields:
        if not isinstance(body.get(f), str) or not body[f].strip():
            raise errors.invalid_request(f"'{f}' must be a non-empty string", f)
    problem = lora_name_problem(body["lora_name"])
    if problem:  # it would become a model id, a log field and a metric label
        raise errors.invalid_request(f"'lora_name': {problem}", "lora_name")
    if need_path and ("\0" in body["lora_path"] or len(body["lora_path"]) > 4096):
        raise errors.invalid_request("'lora_path' must be a directory path (at most 4096 characters, no NUL)",
                                     "lora_path")
    return body["lora_name"], body.get("lora_path", "") if need_path else ""
