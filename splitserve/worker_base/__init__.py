"""What prefill and decode workers share: configuration, the engine thread and what its
failure means, presence on the bus (registration, heartbeats, load reports, KV events),
the admin HTTP port (/health, /metrics), the process around a worker (signals, exit
codes) and the Ray actor that hosts either kind."""
