"""`splitserve.kernels.ops`: the switch between Triton and the torch reference."""

from __future__ import annotations

import inspect

import pytest
import torch

from splitserve.kernels import ops, reference, triton_ops
from tests.kernels.paged_cases import make_paged_kv, randn

OPS = ["paged_decode_attention", "paged_prefill_attention", "store_kv", "pack_blocks",
       "unpack_blocks", "rms_norm", "apply_rotary"]


@pytest.fixture(autouse=True)
def _restore_backend(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_KERNELS", raising=False)
    yield
    ops.set_backend(None)


@pytest.mark.parametrize("name", OPS)
def test_triton_backend_has_the_reference_signatures(name):
    assert inspect.signature(getattr(triton_ops, name)) == inspect.signature(getattr(reference, name))


def _spy(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("forced,expected", [("triton", "triton"), ("reference", "reference")])
def test_set_backend_forces_one_implementation(monkeypatch, device, forced, expected):
    triton_calls = _spy(monkeypatch, triton_ops, "rms_norm")
    reference_calls = _spy(monkeypatch, reference, "rms_norm")
    ops.set_backend(forced)
    x = randn((2, 64), torch.float32, device)
    ops.rms_norm(x, torch.ones(64, device=device), 1e-6)
    assert (triton_calls, reference_calls) == ((["rms_norm"], []) if expected == "triton" else ([], ["rms_norm"]))


def test_environment_variable_selects_the_backend(monkeypatch, device):
    triton_calls = _spy(monkeypatch, triton_ops, "pack_blocks")
    monkeypatch.setenv("SPLITSERVE_KERNELS", "triton")
    ops.pack_blocks(torch.zeros((2, 1, 2, 16, 1, 64), device=device), torch.tensor([1]))
    assert triton_calls == ["pack_blocks"]


def test_auto_uses_triton_for_cuda_tensors_and_native_on_cpu():
    assert ops.backend_for(torch.zeros(1)) == "native"
    if torch.cuda.is_available():
        assert ops.backend_for(torch.zeros(1, device="cuda")) == "triton"


def test_unknown_backend_names_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        ops.set_backend("cuda")
    monkeypatch.setenv("SPLITSERVE_KERNELS", "fast")
    with pytest.raises(ValueError, match="SPLITSERVE_KERNELS='fast' is not one of"):
        ops.backend_for(torch.zeros(1))


def test_both_backends_agree_through_ops(device):
    kv = make_paged_kv([23, 4], 2, 64, torch.float32, device)
    q = randn((2, 8, 64), torch.float32, device)
    results = {}
    for name in ("triton", "reference"):
        ops.set_backend(name)
        results[name] = ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                                   kv.seq_lens, 0.125, num_splits=2)
    torch.testing.assert_close(results["triton"], results["reference"], atol=1e-5, rtol=1e-5)


def test_cpu_tensors_without_the_interpreter_get_an_actionable_error():
    """What a caller sees when Triton was imported without TRITON_INTERPRET=1."""
    from splitserve.kernels.triton_common import Kernel

    k = Kernel.__new__(Kernel)
    k.interpreted = False
    with pytest.raises(RuntimeError, match="need CUDA tensors, got cpu.*TRITON_INTERPRET=1"):
        k.for_tensors("rms_norm", torch.zeros(1))
    k.interpreted = True
    with pytest.raises(ValueError, match=r"different devices \(cpu, meta\)"):
        k.for_tensors("rms_norm", torch.zeros(1), torch.zeros(1, device="meta"))
