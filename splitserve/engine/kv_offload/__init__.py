"""KV offload tiers under the device pool: host memory (host_tier.py) and local disk
(disk_tier.py), fed and read by the offloader (offloader.py), which the block manager
calls when a cached block goes idle, is about to be reused, or is missed on device."""
