"""What the offload tiers have done, as other threads may read it (metrics, /health)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OffloadCounters:
    """Running totals, kept by the offloader under its lock; `tier` keys are host / disk."""

    stored_blocks: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    loaded_blocks: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    lookup_blocks: int = 0  # blocks looked up in the tiers (missed on device)
    hit_blocks: int = 0  # ... of which a tier held the block (the leading run)
    dropped_blocks: int = 0  # reused on device before they could be written down
    write_failures: int = 0  # disk writes that failed (a full disk): the block is dropped
    read_failures: int = 0  # missing, short or corrupt files: a miss, the block is recomputed
    # the disk tier's failures by kind (guarded_disk.FAILURE_KINDS), each disjoint: read, write and
    # remove errors, timeouts, and writes skipped while the tier was switched off
    disk_failures: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class OffloadStats:
    block_nbytes: int
    host_blocks: int
    host_capacity: int
    disk_blocks: int
    disk_capacity: int
    pending_blocks: int  # cached blocks not yet written down
    counters: OffloadCounters
    disk_on: bool = True  # the disk tier is in use (not switched off after failures, no operation hung)

    @property
    def hit_rate(self) -> float:
        c = self.counters
        return c.hit_blocks / c.lookup_blocks if c.lookup_blocks else 0.0
