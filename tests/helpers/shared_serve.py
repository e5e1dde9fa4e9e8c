"""`splitserve serve` processes shared by test modules, one per (model, layout) and session.

A module that needs a plain serving stack asks for a layout here instead of starting its
own (each start is 10-20 s of Ray, actors and model load). tests/suite/plan.py puts the
modules of one layout in one parallel unit, so the process is started once. A layout is a
checkpoint family (tests/helpers/checkpoints.py) and the serve flags; tests must leave the
process as they found it (no killed workers, no changed settings).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # processes.py needs redis and Ray: tests/suite/plan.py reads USERS without them
    from tests.helpers.processes import SplitserveProcess

SERVED = "m"
LAYOUTS: dict[str, tuple[str, list[str]]] = {
    # one decode worker, no prefill worker: the layout of `bench compare` and of CPU pinning
    "llama-0p1d": ("llama", ["--served-model-name", SERVED, "--prefill-workers", "0", "--decode-workers", "1"]),
}
# which modules use which layout: one parallel unit each (tests/suite/plan.py)
USERS = {
    "tests/benchmark/test_compare.py": "llama-0p1d",
    "tests/workers/test_cpu_pinning.py": "llama-0p1d",
}


class SharedServes:
    def __init__(self, make_ckpt):
        self.make_ckpt = make_ckpt
        self.running: dict[str, SplitserveProcess] = {}

    def get(self, layout: str) -> SplitserveProcess:
        if layout not in self.running:
            family, args = LAYOUTS[layout]
            from tests.helpers.processes import SplitserveProcess

            self.running[layout] = SplitserveProcess("serve", ["--model", str(self.make_ckpt(family)), *args])
        return self.running[layout]

    def stop_all(self) -> list[str]:
        """Stop every process; what went wrong on the way out (a non-zero exit)."""
        problems = []
        for layout, proc in self.running.items():
            proc.stop()
            if proc.proc.returncode != 0:
                problems.append(f"shared serve {layout} exited {proc.proc.returncode}:\n{proc.log()[-3000:]}")
        return problems
