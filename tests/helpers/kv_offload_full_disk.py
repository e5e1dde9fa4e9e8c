"""Run in a child process whose file-size limit (RLIMIT_FSIZE) is below one KV block file:
every disk-tier write fails in the kernel as on a full disk. Prints, as JSON, the tokens
of PREFIX before and after its blocks were evicted from the device, and the accounting.

    python -m tests.helpers.kv_offload_full_disk CHECKPOINT DISK_DIR
"""

import json
import sys
from pathlib import Path

from tests.engine.test_kv_offload_tiers import PREFIX, evict_device, generate, tiered


def main(ckpt: str, disk_dir: str) -> None:
    with tiered(Path(ckpt), disk_dir=Path(disk_dir), disk_blocks=64) as llm:
        first = generate(llm, PREFIX)
        evict_device(llm)
        again = generate(llm, PREFIX)
        off = llm.engine.offloader
        c = off.stats().counters
        print(json.dumps({"first": first.token_ids, "again": again.token_ids, "cached": again.num_cached_tokens,
                          "write_failures": c.write_failures, "stored_disk": c.stored_blocks["disk"],
                          "files": [p.name for p in off.disk.files()], "indexed": len(off.disk),
                          "free": llm.engine.num_free_blocks, "total": llm.engine.num_total_blocks}))


if __name__ == "__main__":
    main(*sys.argv[1:])
