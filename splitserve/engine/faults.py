"""Fault injection for chaos tests: make one engine fail the way real engines do.

Off unless `SPLITSERVE_FAULT_INJECTION` is set (never in production). It holds a JSON
list of faults, each {"engine": <worker id>, "fault": "die" | "raise" | "hang" | "slow",
"at_step": N, "once_file": <path, optional>, "step_ms": <for slow>}:
- die: the engine thread dies before step N (as after an unrecoverable error);
- raise: step N raises, as a CUDA error or a kernel bug would (the step's requests
  fail and the loop goes on);
- hang: step N never returns (a wedged kernel or a deadlock).
- slow: every step from N on takes `step_ms` longer (a throttled or shared accelerator).
  Chaos tests use it to keep streams open for seconds whatever the machine's speed, so a
  fault lands mid-stream even when the test client falls behind.
With `once_file`, a fault fires only if that file does not exist yet and creates it,
so a worker restarted with the same environment (a Ray actor) does not fail again.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENV = "SPLITSERVE_FAULT_INJECTION"
KINDS = ("die", "raise", "hang", "slow")


class InjectedEngineDeath(BaseException):  # noqa: N818 - not an Exception: nothing may catch it as one
    """Raised by a `die` fault: escapes the step's error handling like a fatal error."""


class InjectedStepError(RuntimeError):
    """Raised by a `raise` fault: an ordinary failed step."""


_HANG = threading.Event()


def release_hangs() -> None:
    """Let every `hang` fault return (tests: so the thread can be joined)."""
    _HANG.set()


@dataclass
class Fault:
    kind: str
    at_step: int
    once_file: str | None = None
    step_ms: float = 0.0
    fired: bool = False


class FaultPlan:
    def __init__(self, faults: list[Fault]):
        self.faults = faults

    @classmethod
    def from_env(cls, engine_name: str) -> FaultPlan:
        raw = os.environ.get(ENV)
        if not raw:
            return cls([])
        try:
            specs = json.loads(raw)
            faults = [Fault(s["fault"], int(s["at_step"]), s.get("once_file"), float(s.get("step_ms", 0)))
                      for s in specs if s.get("engine") == engine_name]
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"${ENV} must be a JSON list of {{engine, fault, at_step[, once_file, step_ms]}}: {exc}") from None
        for f in faults:
            if f.kind not in KINDS:
                raise ValueError(f"${ENV}: fault {f.kind!r} is not one of {KINDS}")
            if (f.kind == "slow") != (f.step_ms > 0):
                raise ValueError(f"${ENV}: step_ms > 0 goes with fault 'slow' and only with it (got {f})")
            if f.kind == "slow" and f.once_file is not None:
                raise ValueError(f"${ENV}: a 'slow' fault lasts, it takes no once_file (got {f})")
        if faults:
            log.warning("engine %s: fault injection armed: %s", engine_name, faults)
        if any(f.kind == "hang" for f in faults):
            _HANG.clear()  # a test may have released earlier hangs
        return cls(faults)

    def before_step(self, step: int) -> None:
        """Called by the engine thread before each step (a no-op without faults)."""
        for f in self.faults:
            if f.kind == "slow":
                if step >= f.at_step:
                    time.sleep(f.step_ms / 1000)
                continue
            if f.fired or step < f.at_step or not self._claim(f):
                continue
            log.warning("injecting fault %r at engine step %d", f.kind, step)
            if f.kind == "die":
                raise InjectedEngineDeath(f"injected engine death at step {step}")
            if f.kind == "raise":
                raise InjectedStepError(f"injected step failure at step {step}")
            _HANG.wait()  # hang: this step does not return (until a test calls release_hangs)

    @staticmethod
    def _claim(f: Fault) -> bool:
        f.fired = True
        if f.once_file is None:
            return True
        try:
            with open(f.once_file, "x"):
                return True
        except FileExistsError:
            return False
