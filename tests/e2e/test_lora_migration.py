"""A stream under a LoRA adapter survives the death of its decode worker: the router
migrates it (prompt + tokens so far) to the other decode worker under the same adapter
(Sampling.lora_name; the prompt hashed with the adapter's salt), and the client's text is
exactly transformers + PeftModel's greedy continuation. Real processes: redis-server, two
`splitserve decode-worker`s with --enable-lora, a router; the victim is SIGKILLed."""

from __future__ import annotations

import threading

import openai
import pytest
import requests

from splitserve.core.tokenizer import Tokenizer
from tests.helpers.lora_adapters import ADAPTERS, make_adapter, peft_greedy
from tests.reliability.cluster import Cluster
from tests.reliability.conftest import metric, wait_for

NEW = 160  # with 20 ms added to every decode step: >= 3 s a stream, so the kill lands mid-stream


@pytest.fixture(scope="module")
def lora_cluster(make_ckpt, tmp_path_factory):
    base = make_ckpt("llama")
    adapter = make_adapter(base, tmp_path_factory.mktemp("adapters") / "all-r8", **ADAPTERS["all-r8"])
    c = Cluster(base, tmp_path_factory.mktemp("lora-cluster"), decode_step_ms=20.0,
                engine_args=["--num-kv-blocks", "128", "--enable-lora", "--lora-modules", f"all-r8={adapter}"])
    c.start_redis()
    try:
        c.start_decode("decode-0")
        c.start_decode("decode-1")
        c.router = c.start_router()
        c.wait_registered(c.router)
        wait_for(lambda: "all-r8" in requests.get(c.router.base_url + "/v1/models", timeout=5).text, 30,
                 "the adapter in /v1/models")
        yield c, base, adapter
    finally:
        c.stop()


def test_a_lora_stream_migrates_and_keeps_its_adapter(lora_cluster):
    cluster, base, adapter = lora_cluster
    client = openai.OpenAI(base_url=cluster.router.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = list(range(200, 230))
    migrations = metric(cluster.router.base_url, "splitserve_request_migrations_total")
    pieces: list[str] = []
    done = threading.Event()

    def run() -> None:
        for chunk in client.completions.create(model="all-r8", prompt=prompt, max_tokens=NEW, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            pieces.extend(c.text for c in chunk.choices)
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: len(pieces) >= 4, 60, "the stream to be under way")
    victim = next(name for name, p in cluster.decode.items()
                  if requests.get(p.match.group(3) + "/health", timeout=5).json().get("streams", 0))
    cluster.decode[victim].freeze()
    cluster.decode[victim].kill()
    thread.join(timeout=120)
    assert done.is_set()
    assert "".join(pieces) == Tokenizer(base).decode(peft_greedy(base, adapter, prompt, NEW))
    assert metric(cluster.router.base_url, "splitserve_request_migrations_total") - migrations == 1
