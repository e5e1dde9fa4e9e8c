"""KV offload tiers under tensor parallelism (engine/kv_offload/device_blocks.py): with two
ranks, each holding one of Llama's two KV heads, a prefix evicted from the device pools comes
back from the host tier and from the disk tier with exactly transformers' (and one rank's)
greedy tokens; a block file damaged in one rank's heads, or gone, is a miss for both ranks
and recomputes the same tokens; a peer pull from the tp=2 engine's tiers, into a tp=2 engine,
serves the same tokens; a graceful close removes the disk tier's directory.

One tp=2 engine for the module (rank processes are costly); each test starts from an empty
prefix cache and empty tiers (reset_prefix_cache) and reads counter deltas."""

import pytest

from splitserve.core.hashing import block_hashes
from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.kv_offload.block_file import HEADER
from splitserve.engine.llm import LLM
from tests.engine.test_kv_offload_tiers import block_nbytes
from tests.helpers.reference import hf_greedy

BS = 16
NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
PREFIX = [(i * 37 + 11) % 900 + 5 for i in range(100)]  # 6 full blocks are reusable (the last token never is)
POOL_BLOCKS = 12
HOST_BLOCKS = 24


def filler(seed: int) -> list[int]:
    """A prompt that takes the whole device pool (180 + 6 tokens: 12 blocks): nothing of an
    earlier prompt stays on the device, and 11 of its blocks go to the tiers."""
    return [(i * 53 + seed * 101) % 900 + 5 for i in range(180)]


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("llama")  # 2 KV heads: one per rank


@pytest.fixture(scope="module")
def reference(ckpt):
    """transformers' greedy tokens for PREFIX, which one rank's engine gives too."""
    want = hf_greedy(ckpt, PREFIX, NEW)
    with LLM(str(ckpt), num_kv_blocks=POOL_BLOCKS, block_size=BS) as llm:
        assert llm.generate(PREFIX, GREEDY)[0].token_ids == want
    return want


@pytest.fixture(scope="module")
def llm(ckpt, reference, tmp_path_factory):  # (the one-rank reference first: not beside a TP engine)
    nb = block_nbytes(ckpt)  # every head of a block: the one-rank layout
    with LLM(str(ckpt), num_kv_blocks=POOL_BLOCKS, block_size=BS, tensor_parallel_size=2,
             kv_offload_bytes=HOST_BLOCKS * nb, kv_offload_dir=str(tmp_path_factory.mktemp("tier")),
             kv_offload_dir_bytes=64 * (nb + HEADER.size)) as engine:
        assert engine.engine.runner.kv_pool.spec.num_kv_heads == 1  # rank 0 holds half of each block
        yield engine


@pytest.fixture
def fresh(llm):
    llm.engine.scheduler.bm.reset_prefix_cache()
    assert llm.engine.offloader.wait_idle()
    return llm


def generate(llm: LLM, prompt: list[int]):
    out = llm.generate(prompt, GREEDY)[0]
    assert llm.engine.offloader.wait_idle()
    return out


def prefix_hashes(llm: LLM) -> list[int]:
    return block_hashes(PREFIX, BS, seed=llm.engine.scheduler.bm.hash_seed)[:6]


def loaded(llm: LLM) -> dict[str, int]:
    return dict(llm.engine.offloader.stats().counters.loaded_blocks)


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def assert_idle(llm: LLM) -> None:
    engine, off = llm.engine, llm.engine.offloader
    assert engine.num_free_blocks == engine.num_total_blocks
    assert not off.pending
    assert len(off.host) + len(off.host.free_slots) == off.host.capacity
    assert [p.name for p in off.disk.files()] == sorted(f"{h:016x}.kv" for h in off.disk.tier._index)


def to_disk(llm: LLM) -> None:
    """PREFIX off the device and out of the host tier (its least recently used blocks): on disk only."""
    for seed in (1, 2, 3):
        generate(llm, filler(seed))
    off = llm.engine.offloader
    assert all(h in off.disk and h not in off.host for h in prefix_hashes(llm))


def test_evicted_prefix_comes_back_from_the_host_tier_on_both_ranks(fresh, reference):
    llm = fresh
    assert generate(llm, PREFIX).token_ids == reference
    generate(llm, filler(1))
    assert not set(llm.engine.cached_block_hashes()) & set(prefix_hashes(llm))
    assert all(h in llm.engine.offloader.host for h in prefix_hashes(llm))
    before = loaded(llm)
    again = generate(llm, PREFIX)
    assert again.token_ids == reference
    assert again.num_cached_tokens == 6 * BS
    assert delta(loaded(llm), before) == {"host": 6, "disk": 0}
    assert_idle(llm)


def test_evicted_prefix_comes_back_from_the_disk_tier_on_both_ranks(fresh, reference):
    llm = fresh
    assert generate(llm, PREFIX).token_ids == reference
    to_disk(llm)
    before = loaded(llm)
    again = generate(llm, PREFIX)
    assert again.token_ids == reference
    assert again.num_cached_tokens == 6 * BS
    assert delta(loaded(llm), before) == {"host": 0, "disk": 6}
    assert_idle(llm)


def rank1_heads_offset(llm: LLM) -> int:
    """A byte of rank 1's KV head in a block file (layer 0, keys, token 0, head 1)."""
    spec = llm.engine.offloader.blocks.spec
    assert spec.num_kv_heads == 2 and llm.engine.kv_pool.ranges == [(0, 1), (1, 1)]
    return HEADER.size + spec.head_dim * spec.dtype.itemsize


@pytest.mark.parametrize("damage, cached_blocks", [
    ("rank1-flip", 3),  # a byte of rank 1's heads in block 3: its checksum fails, blocks 0-2 still load
    ("delete", 1),  # block 1's file (both ranks' heads) gone
])
def test_a_damaged_block_file_is_a_miss_for_every_rank(fresh, reference, damage, cached_blocks):
    llm = fresh
    generate(llm, PREFIX)
    to_disk(llm)
    path = llm.engine.offloader.disk.tier.path(prefix_hashes(llm)[cached_blocks])
    if damage == "delete":
        path.unlink()
    else:
        blob = bytearray(path.read_bytes())
        blob[rank1_heads_offset(llm)] ^= 0x01
        path.write_bytes(bytes(blob))
    before, failures = loaded(llm), llm.engine.offloader.stats().counters.read_failures
    again = generate(llm, PREFIX)
    assert again.token_ids == reference
    assert again.num_cached_tokens == cached_blocks * BS
    assert delta(loaded(llm), before) == {"host": 0, "disk": cached_blocks}
    assert llm.engine.offloader.stats().counters.read_failures == failures + 1
    assert_idle(llm)


def test_a_peer_pull_under_tp_moves_the_offloaded_prefix(fresh, reference):
    """Both ends of a peer prefix pull (decode_worker/peer_pull.py, over the KV transfer) on the
    tp=2 engine (one TP engine per process): as the peer it pins PREFIX's blocks, loading them
    back from disk into both ranks' pools, and its every-head pool view is read; then, its cache
    and pools emptied, as the puller it writes them into blocks it reserved (each rank its
    heads), adopts them and serves PREFIX from them with the reference tokens."""
    llm = fresh
    generate(llm, PREFIX)
    to_disk(llm)
    before = loaded(llm)
    pinned, hashes = llm.engine.pin_prefix(PREFIX[:6 * BS], 0)
    assert len(pinned) == 6 and hashes == prefix_hashes(llm)
    assert delta(loaded(llm), before) == {"host": 0, "disk": 6}
    blocks = llm.engine.kv_pool.read(pinned)  # every KV head, the one-rank layout
    llm.engine.unpin(pinned)

    llm.engine.scheduler.bm.reset_prefix_cache()  # the tiers too: nothing left to find but the pull
    for shard in llm.engine.kv_pool.shards:
        shard.zero_()
    ids, want, parent, have = llm.engine.reserve_pull(PREFIX[:6 * BS])
    assert (want, parent, have) == (hashes, None, 0)
    llm.engine.kv_pool.write(ids, blocks)
    llm.engine.adopt_pulled(ids, want, parent)
    before = loaded(llm)
    out = generate(llm, PREFIX)
    assert out.token_ids == reference and out.num_cached_tokens == 6 * BS
    assert delta(loaded(llm), before) == {"host": 0, "disk": 0}
    assert_idle(llm)


def test_a_single_process_engine_beside_it_is_refused(fresh, ckpt, reference):
    """It would load rank 0's slices and wait in the ranks' collectives (engine/executor.py)."""
    with pytest.raises(RuntimeError, match="^a single-process engine cannot start in a process that runs a "
                       "tensor-parallel engine: close that one first, or start this one in another process$"):
        LLM(str(ckpt), num_kv_blocks=POOL_BLOCKS, block_size=BS)
    assert generate(fresh, PREFIX).token_ids == reference  # the tp=2 engine is untouched


def test_a_graceful_close_removes_the_disk_tier(llm):
    """(Last in the module: the engine is closed here, and again, harmlessly, by the fixture.)"""
    generate(llm, PREFIX)
    to_disk(llm)
    tier = llm.engine.offloader.disk.tier
    assert tier.dir.is_dir() and tier.files()
    llm.close()
    assert not tier.dir.exists()
    assert list(tier.parent.iterdir()) == []


def test_disk_only_tier_with_a_kv_head_replicated_on_both_ranks(make_ckpt, tmp_path):
    """Qwen2's one KV head is held by both ranks: a write-down reads it once (rank 0), a
    load-back writes it to both. Disk only: each block goes from the device pools to its file."""
    path = make_ckpt("qwen2")
    want = hf_greedy(path, PREFIX, NEW)
    nb = block_nbytes(path)
    with LLM(str(path), num_kv_blocks=POOL_BLOCKS, block_size=BS, tensor_parallel_size=2,
             kv_offload_dir=str(tmp_path), kv_offload_dir_bytes=64 * (nb + HEADER.size)) as llm:
        off = llm.engine.offloader
        assert off.host is None and off.blocks.spec.block_nbytes == nb
        assert llm.engine.kv_pool.ranges == [(0, 1), (0, 1)]
        assert generate(llm, PREFIX).token_ids == want
        for seed in (1, 2):
            generate(llm, filler(seed))
        assert all(h in off.disk for h in prefix_hashes(llm))
        assert not set(llm.engine.cached_block_hashes()) & set(prefix_hashes(llm))
        for shard in llm.engine.kv_pool.shards:  # nothing of PREFIX left on either rank
            shard.zero_()
        again = generate(llm, PREFIX)
        assert again.token_ids == want
        assert again.num_cached_tokens == 6 * BS
        assert loaded(llm) == {"host": 0, "disk": 6}
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
