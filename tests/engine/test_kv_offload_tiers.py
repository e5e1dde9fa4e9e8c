"""KV offload tiers (engine/kv_offload/): a prefix evicted from the device pool comes back
from the host tier, then from disk once the host tier is full, token-exact with the cold
run; a corrupt, short or missing file is a miss that recomputes the same tokens; every
pool's blocks are back at idle."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.core.hashing import block_hashes
from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.kv_offload.block_file import HEADER
from splitserve.engine.llm import LLM

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PREFIX = [(i * 37 + 11) % 900 + 5 for i in range(100)]  # 6 full blocks are reusable (the last token never is)


def block_nbytes(path: Path) -> int:
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BS * cfg["num_key_value_heads"] * head_dim * 4


def tiered(path: Path, host_blocks: int = 0, disk_dir: Path | None = None, disk_blocks: int = 0) -> LLM:
    nb = block_nbytes(path)
    return LLM(str(path), num_kv_blocks=12, block_size=BS, kv_offload_bytes=host_blocks * nb,
               kv_offload_dir=str(disk_dir) if disk_dir else None,
               kv_offload_dir_bytes=disk_blocks * (nb + HEADER.size))


def generate(llm: LLM, prompt: list[int]):
    out = llm.generate(prompt, GREEDY)[0]
    assert llm.engine.offloader.wait_idle()
    return out


def evict_device(llm: LLM) -> None:
    """Two prompts of 10 blocks each through a 12-block pool: nothing of PREFIX stays on device."""
    for seed in (1, 2):
        generate(llm, [(i * 53 + seed * 101) % 900 + 5 for i in range(150)])
    bm = llm.engine.scheduler.bm
    assert not set(bm.cached_hashes()) & set(prefix_hashes(llm))


def prefix_hashes(llm: LLM) -> list[int]:
    return block_hashes(PREFIX, BS, seed=llm.engine.scheduler.bm.hash_seed)[:6]


def assert_idle(llm: LLM) -> None:
    """Every pool's blocks are accounted for: device all free, host slots used + free = all,
    nothing pending, and the disk directory holds exactly the indexed files."""
    engine, off = llm.engine, llm.engine.offloader
    assert engine.num_free_blocks == engine.num_total_blocks
    assert not off.pending
    if off.host is not None:
        assert len(off.host) + len(off.host.free_slots) == off.host.capacity
    if off.disk is not None:
        assert [p.name for p in off.disk.files()] == sorted(f"{h:016x}.kv" for h in off.disk.tier._index)


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("llama")


@pytest.fixture(scope="module")
def cold(ckpt):
    with LLM(str(ckpt), num_kv_blocks=12, block_size=BS) as llm:
        out = llm.generate(PREFIX, GREEDY)[0]
    assert out.num_cached_tokens == 0
    return out.token_ids


def test_evicted_prefix_comes_back_from_the_host_tier(ckpt, cold):
    with tiered(ckpt, host_blocks=64) as llm:
        assert generate(llm, PREFIX).token_ids == cold
        evict_device(llm)
        again = generate(llm, PREFIX)
        c = llm.engine.offloader.stats().counters
        assert again.token_ids == cold
        assert again.num_cached_tokens == 6 * BS
        assert c.loaded_blocks == {"host": 6, "disk": 0}
        assert c.dropped_blocks == 0
        assert_idle(llm)


def test_host_tier_full_spills_to_disk_and_loads_back(ckpt, cold, tmp_path):
    with tiered(ckpt, host_blocks=8, disk_dir=tmp_path, disk_blocks=64) as llm:
        generate(llm, PREFIX)
        evict_device(llm)
        disk = llm.engine.offloader.disk
        assert all(h in disk and h not in llm.engine.offloader.host for h in prefix_hashes(llm))
        again = generate(llm, PREFIX)
        c = llm.engine.offloader.stats().counters
        assert again.token_ids == cold
        assert again.num_cached_tokens == 6 * BS
        assert c.loaded_blocks["disk"] == 6
        assert_idle(llm)


@pytest.mark.parametrize("damage, cached_blocks", [
    ("flip", 3),  # a payload byte flipped in block 3: its checksum fails, blocks 0-2 still load
    ("truncate", 1),  # block 1 cut short
    ("delete", 0),  # block 0's file gone
])
def test_damaged_tier_file_is_a_miss_and_recomputes_the_same_tokens(ckpt, cold, tmp_path, damage, cached_blocks):
    with tiered(ckpt, disk_dir=tmp_path, disk_blocks=64) as llm:  # disk only: every block is a file
        generate(llm, PREFIX)
        evict_device(llm)
        path = llm.engine.offloader.disk.tier.path(prefix_hashes(llm)[cached_blocks])
        blob = bytearray(path.read_bytes())
        if damage == "flip":
            blob[-100] ^= 0x01
            path.write_bytes(bytes(blob))
        elif damage == "truncate":
            path.write_bytes(bytes(blob[:-1]))
        else:
            path.unlink()
        again = generate(llm, PREFIX)
        c = llm.engine.offloader.stats().counters
        assert again.token_ids == cold
        assert again.num_cached_tokens == cached_blocks * BS
        assert c.read_failures == 1 and c.loaded_blocks["disk"] == cached_blocks
        assert_idle(llm)


def test_offload_events_report_the_tier(ckpt, tmp_path):
    with tiered(ckpt, host_blocks=8, disk_dir=tmp_path, disk_blocks=64) as llm:
        llm.engine.drain_block_events()
        generate(llm, PREFIX)
        events = llm.engine.drain_block_events()
        host_stored = [h for e in events if e.kind == "stored" and e.tier == "host" for h in e.block_hashes]
        assert set(prefix_hashes(llm)) <= set(host_stored)
        evict_device(llm)
        llm.engine.drain_block_events()
        generate(llm, PREFIX)  # loaded back: stored on the device again
        events = llm.engine.drain_block_events()
        device_stored = [h for e in events if e.kind == "stored" and e.tier == "device" for h in e.block_hashes]
        assert prefix_hashes(llm) == device_stored[:6]


def test_reset_prefix_cache_empties_the_tiers(ckpt, tmp_path):
    with tiered(ckpt, host_blocks=8, disk_dir=tmp_path, disk_blocks=64) as llm:
        generate(llm, PREFIX)
        evict_device(llm)
        llm.engine.scheduler.bm.reset_prefix_cache()
        off = llm.engine.offloader
        assert off.wait_idle()  # the files are removed on the disk thread
        assert len(off.host) == 0 and len(off.disk) == 0 and off.disk.files() == []
        assert generate(llm, PREFIX).num_cached_tokens == 0


def test_the_disk_tier_directory_is_removed_at_close(ckpt, tmp_path):
    llm = tiered(ckpt, disk_dir=tmp_path, disk_blocks=64)
    generate(llm, PREFIX)
    llm.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fields, message", [
    (dict(kv_offload_dir="/tmp/x"), "go together"),
    (dict(kv_offload_dir_bytes=1 << 20), "go together"),
    (dict(kv_offload_bytes=1 << 20, enable_prefix_caching=False), "prefix caching"),
    (dict(kv_offload_bytes=-1), ">= 0"),
])
def test_bad_offload_configuration_is_one_clear_error(ckpt, fields, message):
    from splitserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(ckpt), **fields)


def test_a_full_disk_drops_the_blocks_and_recomputes_the_same_tokens(ckpt, cold, tmp_path):
    """The kernel refuses every block file (RLIMIT_FSIZE below a file's size, as ENOSPC would)."""
    limit = block_nbytes(ckpt) // 2

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    run = subprocess.run([sys.executable, "-m", "tests.helpers.kv_offload_full_disk", str(ckpt), str(tmp_path)],
                         capture_output=True, text=True, timeout=300, preexec_fn=small_files, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["first"] == result["again"] == cold
    assert result["cached"] == 0 and result["stored_disk"] == 0 and result["write_failures"] > 0
    assert result["files"] == [] and result["indexed"] == 0
    assert result["free"] == result["total"]


def test_offload_counters_become_worker_metrics(ckpt):
    from prometheus_client import generate_latest

    from splitserve.metrics import Metrics, sync_kv_offload

    with tiered(ckpt, host_blocks=64) as llm:
        generate(llm, PREFIX)
        evict_device(llm)
        generate(llm, PREFIX)
        metrics = Metrics()
        for _ in range(2):  # synced twice: counters advance by the difference only
            sync_kv_offload(metrics, "decode", "d0", llm.engine.stats().kv_offload)
    text = generate_latest(metrics.registry).decode()
    nb = block_nbytes(ckpt)
    assert 'splitserve_kv_offload_loaded_blocks_total{role="decode",tier="host",worker="d0"} 6.0' in text
    assert f'splitserve_kv_offload_loaded_bytes_total{{role="decode",tier="host",worker="d0"}} {6.0 * nb}' in text
    assert 'splitserve_kv_offload_blocks{role="decode",state="capacity",tier="host",worker="d0"} 64.0' in text


# ---- hostile tier files (issue 48): a miss and the same tokens, never an error or a stall ----
def disk_files(llm: LLM) -> list[Path]:
    return [llm.engine.offloader.disk.tier.path(h) for h in prefix_hashes(llm)]


@pytest.mark.parametrize("attack", ["fifo", "symlink_dev_zero", "immutable"])
def test_hostile_tier_files_recompute_the_same_tokens(ckpt, cold, tmp_path, attack):
    with tiered(ckpt, disk_dir=tmp_path, disk_blocks=64) as llm:
        generate(llm, PREFIX)
        evict_device(llm)
        files = disk_files(llm)
        if attack == "immutable":  # every read passes, but nothing can be removed (chattr +i)
            subprocess.run(["chattr", "+i", *map(str, files)], check=True)
        else:
            files[2].unlink()
            os.mkfifo(files[2]) if attack == "fifo" else files[2].symlink_to("/dev/zero")
        try:
            again = generate(llm, PREFIX)
            llm.engine.scheduler.bm.reset_prefix_cache()  # removes every file: refused under chattr +i
            assert llm.engine.offloader.wait_idle()  # the removals ran (on the disk thread)
            after_reset = generate(llm, PREFIX)
        finally:
            if attack == "immutable":
                subprocess.run(["chattr", "-i", *map(str, files)], check=True)
        c = llm.engine.offloader.stats().counters
        assert again.token_ids == after_reset.token_ids == cold
        assert again.num_cached_tokens == (6 if attack == "immutable" else 2) * BS
        assert c.disk_failures["remove"] == (6 if attack == "immutable" else 0)
        assert c.disk_failures["read"] == (0 if attack == "immutable" else 1)


def test_block_files_of_another_model_are_never_used(make_ckpt, ckpt, cold, tmp_path):
    """Same tokenizer, same pool layout, same block hashes: the red-team's copy was accepted
    (960 cached tokens, an answer of neither model). The MAC makes it a miss."""
    other = tmp_path / "another" / ckpt.name  # same served name: same block hashes, as the red team had
    shutil.copytree(make_ckpt("llama", initializer_range=0.2), other)
    with tiered(other, disk_dir=tmp_path / "other", disk_blocks=64) as theirs, \
            tiered(ckpt, disk_dir=tmp_path / "mine", disk_blocks=64) as mine:
        for llm in (theirs, mine):
            generate(llm, PREFIX)
            evict_device(llm)
        assert prefix_hashes(theirs) == prefix_hashes(mine)
        for src, dst in zip(disk_files(theirs), disk_files(mine), strict=True):
            shutil.copyfile(src, dst)
        again = generate(mine, PREFIX)
        assert again.token_ids == cold and again.num_cached_tokens == 0
        assert mine.engine.offloader.stats().counters.disk_failures["read"] == 1
        assert_idle(mine)


def test_a_deleted_tier_directory_is_made_again_and_used_again(ckpt, cold, tmp_path):
    with tiered(ckpt, disk_dir=tmp_path, disk_blocks=64) as llm:
        generate(llm, PREFIX)
        evict_device(llm)
        llm.engine.drain_block_events()
        shutil.rmtree(llm.engine.offloader.disk.tier.dir)
        again = generate(llm, PREFIX)
        assert again.token_ids == cold and again.num_cached_tokens == 0
        removed = {h for e in llm.engine.drain_block_events() if e.kind == "removed" and e.tier == "disk"
                   for h in e.block_hashes}
        assert set(prefix_hashes(llm)) <= removed  # the router forgets them
        evict_device(llm)  # written down again, into the new directory
        back = generate(llm, PREFIX)
        assert back.token_ids == cold and back.num_cached_tokens == 6 * BS
        assert llm.engine.offloader.stats().disk_on
        assert_idle(llm)
