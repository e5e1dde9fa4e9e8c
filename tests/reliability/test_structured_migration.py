"""A constrained stream survives the death of its decode worker: the router migrates it (prompt
+ tokens so far), the new worker rebuilds the grammar from those tokens, and the openai SDK's
streamed `parse` returns the same Pydantic object as an undisturbed run. Leaves the cluster
with 2 decode + 1 prefill workers, like every test here."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import openai
import requests
from pydantic import BaseModel, Field

from tests.reliability.cluster import SERVED
from tests.reliability.conftest import metric, wait_for


class Inventory(BaseModel):  # ~370 tokens: >= 3.7 s a stream on the cluster's slowed decode steps
    # (cluster.decode_step_ms), so still mid-stream at the kill even when the client's threads are
    # descheduled for a while (a full `make test` on 2 cores)
    owner: str = Field(max_length=8)
    items: list[Annotated[str, Field(min_length=5, max_length=5)]] = Field(min_length=48, max_length=48)
    count: int = Field(ge=0, le=999)


def parse_kwargs(i: int) -> dict:
    return dict(model=SERVED, messages=[{"role": "user", "content": f"List the stock of shop {i}."}],
                response_format=Inventory, temperature=0, max_completion_tokens=1500)


def streams_of(cluster) -> dict[str, int]:
    return {name: requests.get(p.match.group(3) + "/health", timeout=5).json().get("streams", 0)
            for name, p in cluster.live(cluster.decode).items()}


def test_a_constrained_stream_migrates_and_still_parses(cluster):
    base = cluster.router.base_url
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    with ThreadPoolExecutor(4) as pool:  # the undisturbed runs, side by side
        expected = list(pool.map(lambda i: client.chat.completions.parse(**parse_kwargs(i)).choices[0].message.parsed,
                                 range(4)))
    assert all(isinstance(e, Inventory) for e in expected)
    migrations = metric(base, "splitserve_request_migrations_total")
    chunks = [0] * 4
    results: list = [None] * 4

    def run(i: int) -> None:
        with client.chat.completions.stream(**parse_kwargs(i)) as stream:
            for event in stream:
                chunks[i] += event.type == "chunk"
            results[i] = stream.get_final_completion()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: all(n >= 4 for n in chunks), 60, "every stream to be under way")
    # look, then freeze at once: the victim's streams cannot finish between the look and the kill
    busiest = max(streams_of(cluster).items(), key=lambda kv: kv[1])
    cluster.decode[busiest[0]].freeze()
    assert busiest[1] >= 1, busiest
    cluster.decode[busiest[0]].kill()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None for r in results)
    for done, want in zip(results, expected, strict=True):
        assert done.choices[0].finish_reason == "stop" and done.choices[0].message.parsed == want
    # the killed worker's streams moved (one may have finished between the look and the kill)
    moved = metric(base, "splitserve_request_migrations_total") - migrations
    assert 1 <= moved <= busiest[1], (moved, busiest, chunks)
    cluster.decode.pop(busiest[0])
    cluster.start_decode(busiest[0])
    cluster.wait_registered(cluster.router)
    cluster.wait_all_blocks_free()
