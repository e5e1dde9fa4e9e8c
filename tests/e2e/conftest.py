"""`splitserve serve` with 2 prefill + 2 decode workers on a small random Llama, started for
real (Ray, gRPC, KV transfer), once with the in-process bus and once with redis-server and
overlapped decode steps (--async-scheduling)."""

import secrets
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.pools import pools_back_to_idle  # noqa: F401 - autouse: every pool idle after each test
from tests.helpers.processes import SplitserveProcess, start_redis

SERVED = "tiny-llama"
DISAGG_MIN = 24  # prompts with >= 24 uncached tokens go to a prefill worker


@dataclass
class Cluster:
    serve: SplitserveProcess
    model: Path
    redis_url: str | None
    token_file: Path  # the cluster token every gRPC link presents (a second router needs it)

    @property
    def base_url(self) -> str:
        return self.serve.base_url


@pytest.fixture(scope="module", params=["inproc-bus", "redis-bus"])
def cluster(request, make_ckpt, tmp_path_factory):
    model = make_ckpt("llama")
    redis_url, redis_proc = None, None
    token_file = tmp_path_factory.mktemp("token") / "cluster-token"
    token_file.write_text(secrets.token_urlsafe(32))
    args = ["--model", str(model), "--served-model-name", SERVED, "--prefill-workers", "2",
            "--decode-workers", "2", "--num-kv-blocks", "256", "--disagg-min-uncached-tokens", str(DISAGG_MIN),
            "--routing-seed", "7", "--cluster-token-file", str(token_file),
            "--strict-disaggregation"]  # every long prompt takes the KV transfer, idle decode workers too
    if request.param == "redis-bus":  # ... and overlapped decode steps: every test once through engine/overlap.py
        redis_url, redis_proc = start_redis(tmp_path_factory.mktemp("redis"))
        args += ["--redis-url", redis_url, "--async-scheduling"]
    serve = SplitserveProcess("serve", args)
    yield Cluster(serve, model, redis_url, token_file)
    serve.stop()
    assert serve.proc.returncode == 0, serve.log()[-3000:]
    if redis_proc is not None:
        redis_proc.terminate()
        redis_proc.wait(timeout=10)
