"""Datasheet peaks of the GPUs the GPU check may run on, so MBU and MFU are stated against
what the vendor promises, not only against what the bench itself measured (a copy kernel
and a cuBLAS matmul reach ~85-90% and ~80% of these, so a ratio to the measured peak
flatters by that much).

Figures are NVIDIA's: HBM bandwidth, and dense (no sparsity) bf16 tensor-core FLOP/s.
"""

from __future__ import annotations

# (substring of torch.cuda.get_device_name, label, bytes/s, bf16 dense FLOP/s); the first
# match wins, so the most specific names come first ("GH200" before "H200", "H100 PCIe"
# and "H100 NVL" before the SXM part's plain "H100 80GB HBM3").
PEAKS: list[tuple[str, str, float, float]] = [
    ("GH200", "GH200 (HBM3)", 4.0e12, 989e12),
    ("H100 PCIe", "H100 PCIe", 2.0e12, 756e12),
    ("H100 NVL", "H100 NVL", 3.9e12, 835e12),
    ("H100", "H100 SXM", 3.35e12, 989e12),
    ("H200", "H200 SXM", 4.8e12, 989e12),
    ("A100-SXM4-80GB", "A100 SXM 80GB", 2.039e12, 312e12),
    ("A100-SXM4-40GB", "A100 SXM 40GB", 1.555e12, 312e12),
    ("A100 80GB PCIe", "A100 PCIe 80GB", 1.935e12, 312e12),
    ("L40S", "L40S", 0.864e12, 362e12),
]


def datasheet_peaks(device_name: str) -> dict | None:
    """{"label", "hbm_bytes_per_s", "bf16_flops_per_s"} of the device, None when unknown."""
    for key, label, bandwidth, flops in PEAKS:
        if key in device_name:
            return {"label": label, "hbm_bytes_per_s": bandwidth, "bf16_flops_per_s": flops}
    return None
