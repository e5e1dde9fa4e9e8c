"""The native CPU decode attention (kernels/cpu_native.py + cpu_decode_attention.cpp), built
for real with this machine's compiler: against the torch reference on shuffled paged pools,
every head geometry path (unrolled and generic head sizes, GQA groups 1..8), sliding windows
and soft-caps, float32 and bfloat16, one thread and several; bad input refused; and the
fallback to the reference, with one clear warning, where no compiler exists."""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch

from splitserve.kernels import cpu_native, ops, reference
from tests.kernels.paged_cases import TOLERANCES, make_paged_kv, randn

CPU = torch.device("cpu")
LENS = [1, 15, 16, 17, 100, 257]


def _case(heads, kv_heads, dim, dtype, lens=LENS, seed=0):
    kv = make_paged_kv(lens, kv_heads, dim, dtype, CPU, seed=seed)
    return randn((len(lens), heads, dim), dtype, CPU, seed=seed + 1), kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 4, 32), (4, 4, 64), (8, 1, 128), (16, 2, 256), (6, 3, 80)])
def test_native_matches_the_reference(heads, kv_heads, dim, dtype):
    q, kv = _case(heads, kv_heads, dim, dtype)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, dim ** -0.5)
    assert cpu_native.supports(q, kv.k_cache, kv.v_cache)
    got = cpu_native.paged_decode_attention(*args)
    torch.testing.assert_close(got, reference.paged_decode_attention(*args), **TOLERANCES[dtype])


@pytest.mark.parametrize("window,softcap", [(16, 0.0), (0, 5.0), (33, 5.0)])
def test_window_and_softcap_match_the_reference(window, softcap):
    q, kv = _case(8, 2, 64, torch.float32)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125, None, window, softcap)
    torch.testing.assert_close(cpu_native.paged_decode_attention(*args), reference.paged_decode_attention(*args),
                               **TOLERANCES[torch.float32])


def test_several_threads_give_the_same_bits_as_one():
    q, kv = _case(8, 4, 32, torch.float32, lens=[5, 300, 17, 64, 129, 2, 90])
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_native.paged_decode_attention(*args)
        torch.set_num_threads(3)
        several = cpu_native.paged_decode_attention(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, several)


def test_padding_and_other_blocks_are_never_read():
    """NaN everywhere a sequence does not own: any stray read would show in the output."""
    q, kv = _case(4, 2, 32, torch.float32, lens=[3, 20])
    owned = {int(b) for row, n in zip(kv.block_tables, kv.seq_lens.tolist(), strict=True) for b in row[: (n + 15) // 16]}
    poisoned = kv.pool.clone()
    for block in range(poisoned.shape[0]):
        if block not in owned:
            poisoned[block] = float("nan")
    poisoned[int(kv.block_tables[0, 0]), 1, :, 3:] = float("nan")  # sequence 0 owns slots 0..2 only
    out = cpu_native.paged_decode_attention(q, poisoned[:, 1, 0], poisoned[:, 1, 1], kv.block_tables, kv.seq_lens,
                                            0.2)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                                                     kv.seq_lens, 0.2))


def test_a_length_beyond_the_block_table_is_refused_not_read():
    q, kv = _case(4, 2, 32, torch.float32, lens=[20, 20])
    lens = kv.seq_lens.clone()
    lens[1] = kv.block_tables.shape[1] * 16 + 1
    with pytest.raises(ValueError, match="sequence length is outside its block table"):
        cpu_native.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, lens, 0.2)


@pytest.mark.parametrize("bad_id", [-1, 10 ** 6])
def test_a_block_id_outside_the_pool_is_refused_not_read(bad_id):
    """An engine bug must raise, not read (or crash on) memory outside the pool."""
    q, kv = _case(4, 2, 32, torch.float32, lens=[20, 40])
    tables = kv.block_tables.clone()
    tables[1, 2] = bad_id  # position 32.. of sequence 1
    with pytest.raises(ValueError, match="block id is outside the KV pool"):
        cpu_native.paged_decode_attention(q, kv.k_cache, kv.v_cache, tables, kv.seq_lens, 0.2)
    tables[1, 2], tables[0, 2] = kv.block_tables[1, 2], bad_id  # padding past sequence 0's 2 blocks: never read
    torch.testing.assert_close(cpu_native.paged_decode_attention(q, kv.k_cache, kv.v_cache, tables, kv.seq_lens, 0.2),
                               reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                                                kv.seq_lens, 0.2))


def test_ops_dispatch_uses_native_on_cpu_and_the_reference_where_it_cannot(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_KERNELS", raising=False)
    calls = []
    for module in (cpu_native, reference):
        original = module.paged_decode_attention
        monkeypatch.setattr(module, "paged_decode_attention",
                            lambda *a, _m=module.__name__, _f=original, **k: calls.append(_m) or _f(*a, **k))
    for dtype in (torch.float32, torch.float16):
        q, kv = _case(4, 2, 32, dtype, lens=[7])
        ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2)
    assert calls == ["splitserve.kernels.cpu_native", "splitserve.kernels.reference"]  # no float16 kernel


def test_without_a_compiler_the_reference_runs_and_one_warning_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_native, "_library", None)
    monkeypatch.setattr(cpu_native, "_problem", None)
    monkeypatch.delenv("SPLITSERVE_KERNELS", raising=False)
    q, kv = _case(4, 2, 32, torch.float32, lens=[9, 40])
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2)
    with caplog.at_level(logging.WARNING, logger="splitserve.kernels.cpu_native"):
        first, second = ops.paged_decode_attention(*args), ops.paged_decode_attention(*args)
    assert torch.equal(first, reference.paged_decode_attention(*args)) and torch.equal(first, second)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "no-such-compiler" in warnings[0] and "apt-get install g++" in warnings[0]


def test_the_build_is_cached_per_source_and_machine(monkeypatch, tmp_path):
    """The build and its cache key on a one-function source, so the test compiles in a fraction of
    a second, not the kernels' ~15 s three times (they are built, once, by every other test here)."""
    source = tmp_path / "probe.cpp"
    source.write_text('extern "C" int splitserve_probe() { return 7; }\n')
    monkeypatch.setattr(cpu_native, "SOURCES", [source])
    monkeypatch.setattr(cpu_native, "HEADERS", [])
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    compiler = cpu_native._compiler()
    built = cpu_native._build(compiler)
    assert built.parent == tmp_path / "cache" / "kernels" and built.suffix == ".so"
    assert ctypes.CDLL(str(built)).splitserve_probe() == 7  # built with the kernels' flags, and loads
    stamp = built.stat().st_mtime_ns
    assert cpu_native._build(compiler) == built and built.stat().st_mtime_ns == stamp  # not rebuilt
    with monkeypatch.context() as m:
        m.setattr(cpu_native, "_cpu_flags", lambda: "another cpu")
        other_cpu = cpu_native._build(compiler)
    assert other_cpu != built and other_cpu.is_file()
    source.write_text('extern "C" int splitserve_probe() { return 8; }\n')
    changed = cpu_native._build(compiler)
    assert changed not in (built, other_cpu) and ctypes.CDLL(str(changed)).splitserve_probe() == 8


def test_threads_split_the_batch_by_context_not_by_count():
    lens = torch.tensor([5, 300, 17, 64, 129, 2, 90], dtype=torch.int32)
    assert cpu_native._balanced_bounds(lens, 3) == [0, 2, 5, 7]  # 305 / 210 / 92 tokens, not 322 / 195 / 90
    assert cpu_native._balanced_bounds(torch.tensor([7]), 2) == [0, 1, 1]  # an empty slice is a no-op


def test_a_peaked_softmax_matches_the_reference():
    """Scores hundreds apart: the kernel's own exp must still give ~0 and ~1 where libm does."""
    q, kv = _case(8, 4, 32, torch.float32, lens=[40, 300, 3])
    q = q * 60  # score gaps of several hundred
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 32 ** -0.5)
    torch.testing.assert_close(cpu_native.paged_decode_attention(*args), reference.paged_decode_attention(*args),
                               **TOLERANCES[torch.float32])
