"""The native CPU prefill attention (kernels/cpu_native.py + cpu_prefill_attention.cpp), built
for real with this machine's compiler: against the torch reference (SDPA) on shuffled paged
pools — unrolled and generic head sizes, GQA groups 1..8, cached prefixes, several query
tiles, sliding windows and soft-caps, float32 and bfloat16, one thread and several; bad input
refused before anything is read; and which ops dispatch takes it."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import cpu_native, ops, reference
from tests.kernels.paged_cases import TOLERANCES, make_paged_kv, randn

CPU = torch.device("cpu")
# (sequence length, new tokens): a whole prompt, one past a tile (65), a cached prefix with a
# new chunk, one new token after a long prefix, an empty chunk, several tiles (300)
SEQS = [(17, 17), (65, 65), (100, 37), (257, 1), (40, 0), (300, 300)]


def _case(heads, kv_heads, dim, dtype, seqs=SEQS, seed=0):
    lens = [length for length, _ in seqs]
    kv = make_paged_kv(lens, kv_heads, dim, dtype, CPU, seed=seed)
    cu = torch.tensor([0] + torch.tensor([n for _, n in seqs]).cumsum(0).tolist(), dtype=torch.int32)
    q = randn((int(cu[-1]), heads, dim), dtype, CPU, seed=seed + 1)
    return q, kv, cu


def _float64_truth(q, kv, cu, scale, window=0, softcap=0.0):
    """The attention computed plainly in float64: what both float32 paths approximate."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // kv.k_cache.shape[2]
    for b, length in enumerate(kv.seq_lens.tolist()):
        s, e = int(cu[b]), int(cu[b + 1])
        keys = torch.arange(length)
        k = reference._gather_kv(kv.k_cache.double(), kv.block_tables[b], length, "k").clone()
        v = reference._gather_kv(kv.v_cache.double(), kv.block_tables[b], length, "v").clone()
        for i in range(e - s):
            pos = length - (e - s) + i
            visible = (keys <= pos) & ((keys > pos - window) if window else True)
            for h in range(q.shape[1]):
                scores = k[:, h // group] @ q[s + i, h].double() * scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                p = torch.softmax(scores.masked_fill(~visible, float("-inf")), 0)
                out[s + i, h] = p @ v[:, h // group]
    return out


def _both(q, kv, cu, scale, window=0, softcap=0.0, tables=None, lens=None):
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables if tables is None else tables, cu,
            kv.seq_lens if lens is None else lens, scale, window, softcap)
    return cpu_native.paged_prefill_attention(*args), reference.paged_prefill_attention(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 4, 32), (4, 4, 64), (8, 1, 128), (16, 2, 256), (6, 3, 80)])
def test_native_prefill_matches_the_reference(heads, kv_heads, dim, dtype):
    q, kv, cu = _case(heads, kv_heads, dim, dtype)
    got, want = _both(q, kv, cu, dim ** -0.5)
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


@pytest.mark.parametrize("window,softcap", [(16, 0.0), (100, 0.0), (0, 5.0), (33, 5.0)])
def test_window_and_softcap_match_float64(window, softcap):
    q, kv, cu = _case(8, 2, 64, torch.float32, seqs=[(17, 17), (100, 37), (150, 150)])
    got, _ = _both(q, kv, cu, 0.125, window, softcap)
    torch.testing.assert_close(got.double(), _float64_truth(q, kv, cu, 0.125, window, softcap),
                               **TOLERANCES[torch.float32])


def test_a_peaked_softmax_is_as_close_to_float64_as_sdpa():
    """Scores hundreds apart: the kernel's own exp and its online rescaling across key tiles
    must still give ~0 and ~1 where float64 does. At scores this large float32 itself is off
    by ~4e-5 (SDPA too), so the bar is SDPA's own error."""
    q, kv, cu = _case(8, 4, 32, torch.float32, seqs=[(40, 40), (150, 150), (200, 3)])
    q = q * 60
    got, sdpa = _both(q, kv, cu, 32 ** -0.5)
    truth = _float64_truth(q, kv, cu, 32 ** -0.5)
    assert (got.double() - truth).abs().max() <= max(1e-5, 1.5 * (sdpa.double() - truth).abs().max())


def test_several_threads_give_the_same_bits_as_one():
    q, kv, cu = _case(8, 4, 32, torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _both(q, kv, cu, 0.2)
        torch.set_num_threads(3)
        several, _ = _both(q, kv, cu, 0.2)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, several)


def test_padding_and_other_blocks_are_never_read():
    """NaN everywhere a sequence does not own (and in the slots past its length): a stray
    read, or a key past a query's position, would show in the output."""
    q, kv, cu = _case(4, 2, 32, torch.float32, seqs=[(3, 3), (20, 12)])
    owned = {int(b) for row, n in zip(kv.block_tables, kv.seq_lens.tolist(), strict=True) for b in row[: (n + 15) // 16]}
    poisoned = kv.pool.clone()
    for block in range(poisoned.shape[0]):
        if block not in owned:
            poisoned[block] = float("nan")
    poisoned[int(kv.block_tables[0, 0]), 1, :, 3:] = float("nan")  # sequence 0 owns slots 0..2 only
    out = cpu_native.paged_prefill_attention(q, poisoned[:, 1, 0], poisoned[:, 1, 1], kv.block_tables, cu,
                                             kv.seq_lens, 0.2)
    assert not out.isnan().any()
    torch.testing.assert_close(out, _both(q, kv, cu, 0.2)[1])


def test_a_length_beyond_the_block_table_or_below_the_new_tokens_is_refused():
    q, kv, cu = _case(4, 2, 32, torch.float32, seqs=[(20, 20), (20, 5)])
    for bad in (kv.block_tables.shape[1] * 16 + 1, 4):  # past its blocks; fewer than its 5 new tokens
        lens = kv.seq_lens.clone()
        lens[1] = bad
        with pytest.raises(ValueError, match="sequence length is outside its block table"):
            _both(q, kv, cu, 0.2, lens=lens)


@pytest.mark.parametrize("bad_id", [-1, 10 ** 6])
def test_a_block_id_outside_the_pool_is_refused_not_read(bad_id):
    q, kv, cu = _case(4, 2, 32, torch.float32, seqs=[(20, 20), (40, 8)])
    tables = kv.block_tables.clone()
    tables[1, 2] = bad_id  # position 32.. of sequence 1
    with pytest.raises(ValueError, match="block id is outside the KV pool"):
        cpu_native.paged_prefill_attention(q, kv.k_cache, kv.v_cache, tables, cu, kv.seq_lens, 0.2)


def test_ops_dispatch_takes_native_only_where_it_was_measured_faster(monkeypatch):
    """float32 with an unrolled head size goes native; bfloat16 and head_dim 80 (slower there
    than SDPA, measured) and float16 (no kernel) take the reference."""
    monkeypatch.delenv("SPLITSERVE_KERNELS", raising=False)
    calls = []
    for module in (cpu_native, reference):
        original = module.paged_prefill_attention
        monkeypatch.setattr(module, "paged_prefill_attention",
                            lambda *a, _m=module.__name__, _f=original, **k: calls.append(_m.rsplit(".")[-1])
                            or _f(*a, **k))
    for dtype, dim in ((torch.float32, 32), (torch.bfloat16, 32), (torch.float32, 80), (torch.float16, 64)):
        q, kv, cu = _case(4, 2, dim, dtype, seqs=[(7, 7)])
        ops.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.2)
    assert calls == ["cpu_native", "reference", "reference", "reference"]


def _cpu_has(*flags: str) -> bool:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return False
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return all(f in line.split() for f in flags)


@pytest.mark.skipif(not _cpu_has("avx2", "fma"), reason="this CPU cannot run an AVX2 build")
@pytest.mark.skipif(cpu_native.MARCH != "native", reason="already a cross build")
def test_the_avx2_build_matches_the_reference_too():
    """The kernel's tile has a second shape for CPUs without AVX-512 (where the first spilled
    its registers and ran 20x slower than SDPA): this machine builds it with -march=haswell
    and runs this module's reference comparisons on it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "SPLITSERVE_CPU_MARCH": "haswell", "SPLITSERVE_TEST_BUDGET": "off"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", __file__,
                           "-k", "reference and not avx2"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
