"""spec.<role>.kvOffload: a role's KV offload tiers (engine/kv_offload/). `hostGiB` becomes the
workers' --kv-offload-gib (host memory: count it in the pod's memory limit); `disk` a volume
mounted at /kv-offload, an emptyDir sized above the tier (kubelet evicts a pod whose emptyDir
outgrows its sizeLimit) or a PersistentVolumeClaim, and --kv-offload-dir /kv-offload
--kv-offload-dir-gib. Several workers may share one claim: each writes under its own
subdirectory. Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .spec_fields import float_field

MOUNT = "/kv-offload"
VOLUME = "kv-offload"
VOLUME_KINDS = ("emptyDir", "pvc")


@dataclass(frozen=True)
class KVOffloadSpec:
    host_gib: float = 0.0
    disk_gib: float = 0.0  # 0: no disk tier
    disk_volume: str = "emptyDir"
    claim_name: str = ""

    @property
    def empty_dir_size_limit(self) -> str:
        """The tier's files plus headroom (a block file's header, a temporary while renaming)."""
        return f"{math.ceil(self.disk_gib * 1024 * 1.05) + 256}Mi"


def parse_kv_offload(role: dict, where: str, problems: list[str]) -> KVOffloadSpec:
    d = role.get("kvOffload", {})
    if not isinstance(d, dict):
        problems.append(f"{where}.kvOffload must be an object, got {type(d).__name__}")
        return KVOffloadSpec()
    host = float_field(d, "hostGiB", 0.0, f"{where}.kvOffload", problems)
    disk = d.get("disk")
    if host < 0:
        problems.append(f"{where}.kvOffload.hostGiB must be >= 0, got {host:g}")
    if disk is None:
        return KVOffloadSpec(host_gib=max(host, 0.0))
    if not isinstance(disk, dict):
        problems.append(f"{where}.kvOffload.disk must be an object, got {type(disk).__name__}")
        return KVOffloadSpec(host_gib=max(host, 0.0))
    size = float_field(disk, "sizeGiB", 0.0, f"{where}.kvOffload.disk", problems)
    kind, claim = disk.get("volume", "emptyDir"), disk.get("claimName", "")
    if not size > 0:
        problems.append(f"{where}.kvOffload.disk.sizeGiB must be > 0, got {size:g}")
    if kind not in VOLUME_KINDS:
        problems.append(f"{where}.kvOffload.disk.volume must be one of {list(VOLUME_KINDS)}, got {kind!r}")
    elif kind == "pvc" and not (isinstance(claim, str) and claim):
        problems.append(f"{where}.kvOffload.disk.claimName is required with volume pvc")
    return KVOffloadSpec(max(host, 0.0), max(size, 0.0), kind, claim if isinstance(claim, str) else "")


def kv_offload_args(o: KVOffloadSpec) -> list[str]:
    args = ["--kv-offload-gib", f"{o.host_gib:g}"] if o.host_gib else []
    if o.disk_gib:
        args += ["--kv-offload-dir", MOUNT, "--kv-offload-dir-gib", f"{o.disk_gib:g}"]
    return args


def kv_offload_volumes(o: KVOffloadSpec) -> list[dict]:
    if not o.disk_gib:
        return []
    if o.disk_volume == "pvc":
        return [{"name": VOLUME, "persistentVolumeClaim": {"claimName": o.claim_name}}]
    return [{"name": VOLUME, "emptyDir": {"sizeLimit": o.empty_dir_size_limit}}]


def kv_offload_mounts(o: KVOffloadSpec) -> list[dict]:
    return [{"name": VOLUME, "mountPath": MOUNT}] if o.disk_gib else []
