"""Which GPUs `splitserve serve`'s worker actors ask Ray for. Ray hides every GPU from an
actor that asks for none (CUDA_VISIBLE_DEVICES=""), so a CUDA worker that asked for none
would find no device."""

import pytest

from splitserve.serve import gpus_per_worker, main


@pytest.mark.parametrize(("workers", "gpus", "share"), [
    (2, 1, 0.5),   # one GPU, a prefill and a decode worker: half each
    (3, 1, 1 / 3),
    (2, 8, 1.0),   # enough GPUs: a whole one each
    (3, 2, 0.5),   # two on one GPU, one on the other: never more than one GPU's worth on a GPU
    (5, 2, 1 / 3),
    (4, 4, 1.0),
])
def test_cuda_workers_share_the_gpus_ray_sees(workers, gpus, share):
    assert gpus_per_worker("cuda", workers, gpus) == pytest.approx(share)
    per_gpu = -(-workers // int(gpus)) if share < 1 else 1
    assert per_gpu * share <= 1.0 + 1e-9  # Ray can place them: no GPU over-asked


def test_a_tensor_parallel_worker_asks_for_a_whole_gpu_per_rank():
    assert gpus_per_worker("cuda", 2, 4, tp=2) == 2.0
    assert gpus_per_worker("cpu", 2, 0, tp=2) == 0.0
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size 2: 3 workers need 6 GPUs \(one per rank\), "
                                         r"Ray sees 4$"):
        gpus_per_worker("cuda", 3, 4, tp=2)


def test_cpu_workers_ask_for_no_gpu():
    assert gpus_per_worker("cpu", 2, 8) == 0.0


def test_cuda_without_a_gpu_in_ray_is_a_clear_error():
    with pytest.raises(ValueError, match="Ray sees no GPU"):
        gpus_per_worker("cuda", 2, 0)


def test_a_device_index_is_refused_before_anything_starts(capsys):
    assert main(["--device", "cuda:1"]) == 2
    assert "pass --device cuda" in capsys.readouterr().err


def test_mooncake_with_a_gpu_pool_and_the_non_cuda_build_is_refused_before_anything_starts(capsys):
    # the non-CUDA Mooncake build (this project's test dependency) cannot move GPU memory
    assert main(["--device", "cuda", "--kv-backend", "mooncake"]) == 2
    err = capsys.readouterr().err
    assert "mooncake-transfer-engine-non-cuda" in err and "--kv-backend grpc" in err
