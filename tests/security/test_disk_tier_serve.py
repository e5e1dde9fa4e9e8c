"""The red-team's disk-tier attacks (issue 48), rerun through `splitserve serve`: one decode
worker with a disk KV tier on a small filesystem of its own (a tmpfs), attacked from outside
while it serves. After every attack: no 5xx, no stall, the in-process engine's exact tokens;
the tier back in use once the damage is undone; at most one log line per fault kind and no
traceback; nothing left in the directory after a graceful stop. A directory the workers
cannot write is refused in one line before Ray starts."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.demo import ensure_demo_checkpoint
from tests.helpers.pools import pools_back_to_idle  # noqa: F401 - autouse: the worker's pool idle after
from tests.helpers.processes import SplitserveProcess
from tests.helpers.tmpfs import tmpfs
from tests.reliability.conftest import metric

BS = 16
NEW = 6
PREFIX = [(i * 37 + 11) % 900 + 5 for i in range(320)]  # 20 blocks
QUESTION = PREFIX + [7, 8, 9]
TIER_GIB = 0.0105  # ~170 block files of the demo model (64 KiB each): above what a round writes
FS_SIZE = "12m"  # ~190 block files: above the flag (serve refuses a tier larger than its disk)


def filler(seed: int, n: int = 400) -> list[int]:
    return [(i * 53 + seed * 101) % 900 + 5 for i in range(n)]


@pytest.fixture(scope="module")
def want() -> str:
    """QUESTION's answer from an in-process engine, as text."""
    from splitserve.core.tokenizer import Tokenizer

    model = ensure_demo_checkpoint()
    with LLM(str(model), num_kv_blocks=64) as llm:
        ids = llm.generate(QUESTION, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))[0].token_ids
    return Tokenizer(model).decode(ids)


class TieredServe:
    def __init__(self, tier_dir: Path):
        self.tier_dir = tier_dir
        self.proc = SplitserveProcess("serve", [
            "--prefill-workers", "0", "--decode-workers", "1", "--num-kv-blocks", "48",
            "--kv-offload-dir", str(tier_dir), "--kv-offload-dir-gib", str(TIER_GIB)])
        self.model = ensure_demo_checkpoint().name
        self.admin = re.search(r"metrics (http://[0-9.:]+)/metrics", self.proc.log()).group(1)
        self.filler_seed = 0

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        start = time.monotonic()
        r = requests.post(self.proc.base_url + "/v1/completions", timeout=60, json={
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text  # never a 5xx
        assert time.monotonic() - start < 20, "a request stalled"
        return r.json()

    def files(self) -> list[Path]:
        return sorted(self.tier_dir.glob("kv-*/*.kv"))

    def ask(self, want: str) -> int:
        """QUESTION's answer (checked) and how many of its tokens came from cache."""
        out = self.complete(QUESTION, NEW)
        assert out["choices"][0]["text"] == want
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    def wait_files(self, n: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.files()) < n:
            assert time.monotonic() < deadline, f"the disk tier holds {len(self.files())} files\n{self.tier_log()}"
            time.sleep(0.1)

    def evict_device(self) -> None:
        """Three 25-block prompts through a 48-block pool: QUESTION's blocks leave the device."""
        for _ in range(3):
            self.filler_seed += 1
            self.complete(filler(self.filler_seed), 1)

    def written_down(self, timeout: float = 20.0) -> None:
        """Until the worker's idle blocks reached the disk (its background writer)."""
        deadline = time.monotonic() + timeout
        while metric(self.admin, "splitserve_kv_offload_stored_blocks_total", tier="disk") < 20:
            assert time.monotonic() < deadline, "nothing was written down to the disk tier"
            time.sleep(0.1)
        time.sleep(0.5)

    def tier_log(self) -> str:
        """The worker's disk tier lines, for failure messages."""
        return "".join(ln for ln in self.proc.lines if "KV offload" in ln)[-3000:]

    def round_trip(self, want: str, attack=None) -> int:
        """Ask, push QUESTION off the device, attack the files, ask again: cached tokens of the second."""
        self.ask(want)
        self.written_down()
        self.evict_device()
        time.sleep(0.5)  # the fillers' blocks written down too
        if attack is not None:
            attack(self.files())
        return self.ask(want)


def replace_each(make):
    def attack(files: list[Path]) -> None:
        for f in files:
            f.unlink()
            make(f)
    return attack


def test_disk_tier_attacks_through_serve(want, tmp_path):
    with tmpfs(tmp_path / "tier", FS_SIZE) as tier_dir:
        serve = TieredServe(tier_dir)
        started = time.monotonic()
        try:
            # the tier works: the whole prefix comes back from disk
            assert serve.round_trip(want) == len(PREFIX), serve.tier_log()
            # each block file swapped for a FIFO (blocked the worker in open()), a symlink to
            # /dev/zero (read without bound), another writer's file: misses, the same tokens
            assert serve.round_trip(want, replace_each(os.mkfifo)) == 0
            assert serve.round_trip(want, replace_each(lambda f: f.symlink_to("/dev/zero"))) == 0
            forged = replace_each(lambda f: f.write_bytes(b"SSKV" + os.urandom(65536 + 60)))
            assert serve.round_trip(want, forged) == 0
            # the directory deleted under the worker: made again, and used again
            for sub in tier_dir.glob("kv-*"):
                while sub.exists():  # the worker may be writing into it meanwhile
                    shutil.rmtree(sub, ignore_errors=True)
            serve.wait_files(20)  # noticed within a second; the blocks still on the device written again
            assert serve.round_trip(want) == len(PREFIX), serve.tier_log()
            # someone else fills the filesystem: the tier makes room from its own oldest blocks
            with open(tier_dir / "hog", "wb") as hog:
                try:
                    while True:
                        hog.write(b"\0" * 65536)
                        hog.flush()
                except OSError:
                    pass
            serve.round_trip(want)
            (tier_dir / "hog").unlink()
            assert serve.round_trip(want) == len(PREFIX), serve.tier_log()
            assert metric(serve.admin, "splitserve_kv_offload_tier_up", tier="disk") == 1.0
            # files made immutable (unlink raised inside the engine step: a 503); last, since the
            # disk then fills with files nobody can remove and the tier may switch itself off
            files = serve.files()
            subprocess.run(["chattr", "+i", *map(str, files)], check=True)
            try:
                for _ in range(2):  # fresh fillers overflow the tier: it evicts files it cannot remove
                    serve.ask(want)
                    serve.evict_device()
            finally:
                subprocess.run(["chattr", "-i", *map(str, files)], check=True)
            assert metric(serve.admin, "splitserve_kv_offload_failures_total", kind="read") >= 3
            assert metric(serve.admin, "splitserve_kv_offload_failures_total", kind="remove") >= 1
        finally:
            serve.proc.stop()
        log = serve.proc.log()
        minutes = int((time.monotonic() - started) // 60) + 1
        assert "Traceback" not in log, log[-4000:]
        for kind in ("read", "write", "remove", "timeout"):
            lines = log.count(f"disk tier {kind} failed")
            assert lines <= minutes, (kind, lines, log[-4000:])
        assert list(tier_dir.glob("kv-*")) == []  # a graceful stop leaves nothing behind


def test_a_directory_the_workers_cannot_write_is_refused_before_ray_starts(tmp_path):
    with tmpfs(tmp_path / "ro", "1m", ",ro") as read_only:
        start = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", "--kv-offload-dir",
                              str(read_only / "kv"), "--kv-offload-dir-gib", "0.5"],
                             capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"splitserve serve: --kv-offload-dir {read_only / 'kv'}: cannot write there (Read-only file system): give "
        "the workers' user a writable directory of its own (mode 0700; docs/operations.md, KV offload tiers)"]
    assert time.monotonic() - start < 10
    assert "Ray" not in run.stdout + run.stderr
