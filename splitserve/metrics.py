"""Every Prometheus metric splitserve exports, defined in one place.

Names carry the `splitserve_` prefix; where a metric overlaps with vLLM's it keeps
vLLM's meaning and buckets, so existing dashboards translate. Dashboards and alerts
in the Helm chart may only query names listed here (a test enforces it).
Labels: `role` is router | prefill | decode | operator; `worker` the worker id. No
metric has a label Prometheus sets on scraped series (namespace, pod, service,
container, endpoint, job, instance): the scrape would rename it exported_<name>. So
the operator's series name the InferenceDeployment by `deployment_namespace` and
`deployment`; their `namespace` is the operator's own, from the scrape.

(Over 300 lines on purpose: one declaration per metric, so the chart's queries can be
checked against a single list; the per-feature sync helpers sit at the end.)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

# vLLM's buckets for the overlapping latency histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)


class Metrics:
    """One set of collectors bound to a registry (one per process, or per test)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        ProcessCollector(registry=r)  # process_cpu_seconds_total, resident memory, open fds
        # Request latency, measured at the router (what the client sees).
        self.time_to_first_token = Histogram(
            "splitserve_time_to_first_token_seconds", "Time from request arrival to first token.",
            ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "splitserve_inter_token_latency_seconds", "Time between consecutive output tokens "
            "(a chunk of n tokens under --stream-interval counts as n gaps of a n-th of its wait).",
            ["model"], buckets=ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "splitserve_e2e_request_latency_seconds", "Time from request arrival to its last token.",
            ["model"], buckets=E2E_BUCKETS, registry=r)
        self.request_success = Counter(
            "splitserve_request_success_total", "Finished requests, by finish reason.",
            ["model", "finish_reason"], registry=r)
        self.request_errors = Counter(
            "splitserve_request_errors_total", "Requests answered with an error, by HTTP status code.",
            ["model", "code"], registry=r)
        self.prompt_tokens = Counter(
            "splitserve_prompt_tokens_total", "Prompt tokens processed.", ["model"], registry=r)
        self.generation_tokens = Counter(
            "splitserve_generation_tokens_total", "Output tokens generated.", ["model"], registry=r)
        # Scheduler state, reported by each worker.
        self.num_requests_running = Gauge(
            "splitserve_num_requests_running", "Requests in the running batch.",
            ["role", "worker"], registry=r)
        self.num_requests_waiting = Gauge(
            "splitserve_num_requests_waiting", "Requests waiting to be scheduled.",
            ["role", "worker"], registry=r)
        self.kv_cache_usage = Gauge(
            "splitserve_kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
            ["role", "worker"], registry=r)
        self.state_slot_usage = Gauge(
            "splitserve_recurrent_state_slot_usage_perc", "Hybrid models: fraction of recurrent-state slots in use "
            "(a slot per admitted sequence; engine/recurrent_state.py).", ["role", "worker"], registry=r)
        self.kv_capacity_tokens = Gauge(
            "splitserve_kv_capacity_tokens", "Tokens the worker's KV pool holds (blocks x block size; an fp8 "
            "KV cache holds twice the tokens of bf16 in the same memory).", ["role", "worker"], registry=r)
        self.prefix_cache_queries = Counter(
            "splitserve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
            ["role", "worker"], registry=r)
        self.prefix_cache_hits = Counter(
            "splitserve_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
            ["role", "worker"], registry=r)
        self.num_preemptions = Counter(
            "splitserve_num_preemptions_total", "Requests preempted (recomputed) for lack of KV blocks.",
            ["role", "worker"], registry=r)
        self.overlapped_steps = Counter(
            "splitserve_engine_overlapped_steps_total", "Decode steps launched before the previous step's tokens "
            "reached the host (--async-scheduling); flat while the flag is on means every step drained (requests "
            "with penalties or grammars, or a prompt to prefill, in every step).",
            ["role", "worker"], registry=r)
        # one series per (MoE layer, expert): the input of an expert-load balancer. Counted on the device,
        # copied to the host once a second at most (engine/expert_tokens.py); dense models export none
        self.moe_expert_tokens = Counter(
            "splitserve_moe_expert_tokens", "Tokens the router sent to each expert of each mixture-of-experts "
            "layer (a token counts once per expert it chose, top-k times in all).",
            ["role", "worker", "layer", "expert"], registry=r)
        # KV offload tiers under a worker's device pool (engine/kv_offload/), and peer pulls.
        self.kv_offload_stored_blocks = Counter(
            "splitserve_kv_offload_stored_blocks_total", "Prefix-cache blocks written down to an offload tier "
            "(host: idle device blocks copied by the background writer; disk: host blocks evicted to files).",
            ["role", "worker", "tier"], registry=r)
        self.kv_offload_stored_bytes = Counter(
            "splitserve_kv_offload_stored_bytes_total", "Bytes of the blocks written down to an offload tier.",
            ["role", "worker", "tier"], registry=r)
        self.kv_offload_loaded_blocks = Counter(
            "splitserve_kv_offload_loaded_blocks_total", "Blocks loaded back from an offload tier into the device "
            "pool instead of recomputed.", ["role", "worker", "tier"], registry=r)
        self.kv_offload_loaded_bytes = Counter(
            "splitserve_kv_offload_loaded_bytes_total", "Bytes of the blocks loaded back from an offload tier.",
            ["role", "worker", "tier"], registry=r)
        self.kv_offload_lookup_blocks = Counter(
            "splitserve_kv_offload_lookup_blocks_total", "Prompt blocks missed on device and looked up in the "
            "offload tiers (hit rate: kv_offload_hit_blocks / this).", ["role", "worker"], registry=r)
        self.kv_offload_hit_blocks = Counter(
            "splitserve_kv_offload_hit_blocks_total", "Looked-up blocks an offload tier held.",
            ["role", "worker"], registry=r)
        self.kv_offload_failures = Counter(
            "splitserve_kv_offload_failures_total", "Offload tier failures, each a recompute and never a wrong "
            "token: dropped (reused on device before written down); of the disk tier: write (a write failed: "
            "no space, permissions), read (a missing, short, foreign or corrupt block file), remove (a file could "
            "not be deleted), timeout (the disk did not answer in time), off (not written: the tier was "
            "switched off).", ["role", "worker", "kind"], registry=r)
        self.kv_offload_tier_up = Gauge(
            "splitserve_kv_offload_tier_up", "1 while the worker's disk KV tier is in use; 0 once it was switched "
            "off after failures in a row or a hung operation (its blocks are recomputed; it is retried every few "
            "seconds and comes back by itself: check the directory's permissions, free space and mount).",
            ["role", "worker", "tier"], registry=r)
        self.kv_offload_blocks = Gauge(
            "splitserve_kv_offload_blocks", "Blocks held in an offload tier, by state (used, capacity).",
            ["role", "worker", "tier", "state"], registry=r)
        # Speculative decoding (engine/spec/), vLLM's meaning: acceptance rate = accepted / draft tokens,
        # mean accepted length = 1 + accepted / drafts.
        self.spec_decode_num_drafts = Counter(
            "splitserve_spec_decode_num_drafts", "Sequence steps that verified drafts.", ["role", "worker"], registry=r)
        self.spec_decode_num_draft_tokens = Counter(
            "splitserve_spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", ["role", "worker"],
            registry=r)
        self.spec_decode_num_accepted_tokens = Counter(
            "splitserve_spec_decode_num_accepted_tokens", "Draft tokens accepted.", ["role", "worker"], registry=r)
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "splitserve_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the "
            "draft (0: the first draft token).", ["role", "worker", "position"], registry=r)
        self.kv_peer_pull_blocks = Counter(
            "splitserve_kv_peer_pull_blocks_total", "Prefix blocks moved between decode workers by a peer pull "
            "instead of recomputed: pulled (received here) or pushed (sent from here to a peer).",
            ["worker", "direction"], registry=r)
        self.kv_peer_pull_requests = Counter(
            "splitserve_kv_peer_pull_requests_total", "Peer pulls a decode worker tried, by outcome: ok, failed "
            "(peer gone, transfer or checksum error: the prefix is recomputed, token-exact), skipped (nothing "
            "to pull or no free blocks).", ["worker", "outcome"], registry=r)
        self.kv_peer_pull_seconds = Histogram(
            "splitserve_kv_peer_pull_seconds", "Duration of one successful peer pull, from reserving the blocks "
            "to their adoption into the prefix cache.", ["worker"], buckets=TRANSFER_BUCKETS, registry=r)
        # Worker liveness: the engine thread behind every request.
        self.engine_alive = Gauge(
            "splitserve_engine_alive", "1 while the worker's engine thread runs; 0 once it died (the worker "
            "leaves the registry and exits to be restarted).", ["role", "worker"], registry=r)
        self.engine_step_seconds = Counter(
            "splitserve_engine_step_seconds_total", "Wall time of engine steps (forward pass, sampling, "
            "bookkeeping).", ["role", "worker"], registry=r)
        self.engine_step_cpu_seconds = Counter(
            "splitserve_engine_step_cpu_seconds_total", "CPU time of the engine thread in steps (torch's extra "
            "intra-op threads not included); process_cpu_seconds_total minus this is the worker's serving "
            "overhead.", ["role", "worker"], registry=r)
        self.engine_process_cpu_seconds = Gauge(
            "splitserve_engine_process_cpu_seconds", "CPU seconds used so far by the worker's engine process "
            "(--engine-loop process; absent with an engine thread): process_cpu_seconds_total covers the worker "
            "process only, so a worker's CPU is the sum of both.", ["role", "worker"], registry=r)
        # Where a first token's time goes inside the worker that prefilled it (vLLM's names and
        # meaning; TTFT's buckets: vLLM's request-latency ones start at 0.3 s, too coarse here).
        self.request_queue_time = Histogram(
            "splitserve_request_queue_time_seconds", "Time a request waited in a worker's engine queue: "
            "from its arrival at the engine to the first step that computed its prompt.",
            ["role", "worker"], buckets=TTFT_BUCKETS, registry=r)
        self.request_prefill_time = Histogram(
            "splitserve_request_prefill_time_seconds", "From the first step that computed a request's prompt to "
            "its first token, on the worker that prefilled it (every chunk of a long prompt, and the other work "
            "sharing those steps).", ["role", "worker"], buckets=TTFT_BUCKETS, registry=r)
        self.engine_step_failures = Counter(
            "splitserve_engine_step_failures_total",
            "Engine steps that raised; their requests were failed and retried elsewhere.",
            ["role", "worker"], registry=r)
        # KV transfer between prefill and decode workers.
        self.kv_transfer_bytes = Counter(
            "splitserve_kv_transfer_bytes_total", "KV bytes moved between workers.",
            ["backend", "direction"], registry=r)
        self.kv_transfer_seconds = Histogram(
            "splitserve_kv_transfer_seconds", "Duration of one request's KV transfer.",
            ["backend"], buckets=TRANSFER_BUCKETS, registry=r)
        self.kv_transfer_errors = Counter(
            "splitserve_kv_transfer_errors_total", "Failed KV transfers, by reason.",
            ["backend", "reason"], registry=r)
        self.local_prefill_fallbacks = Counter(
            "splitserve_local_prefill_fallbacks_total",
            "Requests a decode worker prefilled itself after a prefill or transfer failure.",
            ["worker", "reason"], registry=r)
        # Prefill workers: what they hold for pushes and what they refuse (prefill_worker/).
        self.kv_held_blocks = Gauge(
            "splitserve_kv_held_blocks", "KV blocks a prefill worker holds for pushes: prompts computed and not yet "
            "sent or given up. Above 0 with no traffic means blocks that will not come back.",
            ["role", "worker"], registry=r)
        self.kv_held_expired = Counter(
            "splitserve_kv_held_expired_total", "Held prompts a prefill worker released because no request was "
            "left to push them (a bug: the log line names the request).", ["worker"], registry=r)
        self.prefill_refused = Counter(
            "splitserve_prefill_refused_total", "Remote prefills a prefill worker refused at once because its "
            "queue would not clear before the caller's deadline (the decode worker prefilled them itself).",
            ["worker"], registry=r)
        self.prefill_tokens_per_second = Gauge(
            "splitserve_prefill_tokens_per_second", "A prefill worker's measured prompt tokens per busy second "
            "(what its admission uses).", ["worker"], registry=r)
        # Router.
        self.router_decision_seconds = Histogram(
            "splitserve_router_decision_seconds", "Time to choose workers for one request.",
            buckets=DECISION_BUCKETS, registry=r)
        self.router_requests = Counter(
            "splitserve_router_requests_total", "Requests routed, by chosen worker and path.",
            ["worker", "path"], registry=r)
        self.router_held_requests = Gauge(
            "splitserve_router_held_requests",
            "Requests held while no decode worker is registered (scaled to zero; --hold-requests-at-zero).",
            registry=r)
        self.router_index_blocks = Gauge(
            "splitserve_router_index_blocks", "Blocks held in the router's radix index.", registry=r)
        self.router_index_worker_blocks = Gauge(
            "splitserve_router_index_worker_blocks",
            "Blocks of each worker's device prefix cache the router's index knows of: far below what the "
            "worker caches means its KV events are not arriving (check the bus and index resyncs).",
            ["worker"], registry=r)
        self.router_index_resyncs = Counter(
            "splitserve_router_index_resyncs_total",
            "Index resyncs of a worker after a KV event-id gap.", ["worker"], registry=r)
        self.request_migrations = Counter(
            "splitserve_request_migrations_total",
            "Requests moved to another decode worker mid-stream.", ["reason"], registry=r)
        # LoRA adapters (engine/lora/): per adapter, at the router and on each worker.
        self.lora_requests = Counter(
            "splitserve_lora_requests_total", "Finished requests that ran under a LoRA adapter.", ["adapter"],
            registry=r)
        self.lora_generation_tokens = Counter(
            "splitserve_lora_generation_tokens_total", "Output tokens generated under a LoRA adapter.",
            ["adapter"], registry=r)
        self.lora_resident = Gauge(
            "splitserve_lora_resident", "1 while a loaded adapter holds one of the worker's --max-loras slots, "
            "else 0.", ["role", "worker", "adapter"], registry=r)
        self.lora_synced: dict[tuple[str, str], set[str]] = {}  # (role, worker) -> adapters in lora_resident
        self.lora_slot_loads = Counter(
            "splitserve_lora_slot_loads_total", "Times an adapter was copied into a slot (swaps in).",
            ["role", "worker", "adapter"], registry=r)
        self.prefill_pool_actors = Gauge(
            "splitserve_prefill_pool_actors", "Prefill actors the prefill-pool driver keeps alive.", registry=r)
        self.worker_registrations_refused = Counter(
            "splitserve_worker_registrations_refused_total",
            "Workers a router refused to route to: another model or block size than its own.",
            ["reason"], registry=r)
        self.workers_healthy = Gauge(
            "splitserve_workers_healthy", "Workers with a live heartbeat, per role.", ["role"], registry=r)
        # Operator.
        self.operator_replicas = Gauge(
            "splitserve_operator_replicas", "Replicas per role: desired (decided) and ready (observed).",
            ["deployment_namespace", "deployment", "role", "state"], registry=r)
        self.operator_queue_depth = Gauge(
            "splitserve_operator_queue_depth", "Waiting requests per role, as the autoscaler observed.",
            ["deployment_namespace", "deployment", "role"], registry=r)
        self.operator_scale_events = Counter(
            "splitserve_operator_scale_events_total", "Scaling decisions applied, by direction.",
            ["deployment_namespace", "deployment", "role", "direction"], registry=r)
        self._engine_totals: dict[tuple, float] = {}
        self.operator_reconcile_errors = Counter(
            "splitserve_operator_reconcile_errors_total", "Reconciliations that failed.",
            ["deployment_namespace", "deployment"], registry=r)

    def advance(self, counter: Counter, labels: dict, total: float) -> None:
        """Move a counter to a running total kept elsewhere (an engine's), by the difference."""
        key = (id(counter), *sorted(labels.items()))
        delta = total - self._engine_totals.get(key, 0)
        if delta > 0:
            counter.labels(**labels).inc(delta)
        self._engine_totals[key] = total

    def sync_spec_decode(self, role: str, worker: str, stats) -> None:
        """An engine's speculative decoding totals (engine/spec/speculator.py SpecDecodeStats)."""
        for counter, total in ((self.spec_decode_num_drafts, stats.num_drafts),
                               (self.spec_decode_num_draft_tokens, stats.num_draft_tokens),
                               (self.spec_decode_num_accepted_tokens, stats.num_accepted_tokens)):
            self.advance(counter, {"role": role, "worker": worker}, total)
        for pos, total in enumerate(stats.accepted_per_position):
            self.advance(self.spec_decode_num_accepted_tokens_per_pos,
                         {"role": role, "worker": worker, "position": str(pos)}, total)

    def sync_engine_counters(self, role: str, worker: str, prefix_queries: int, prefix_hits: int,
                             preemptions: int, overlapped_steps: int = 0) -> None:
        """Engines keep running totals; counters advance by the difference since last time."""
        for counter, total in ((self.prefix_cache_queries, prefix_queries), (self.prefix_cache_hits, prefix_hits),
                               (self.num_preemptions, preemptions), (self.overlapped_steps, overlapped_steps)):
            self.advance(counter, {"role": role, "worker": worker}, total)


def sync_lora(metrics: Metrics, role: str, worker: str, loras) -> None:
    """A worker's adapters (EngineStats.loras: name, salt, resident, slot loads) into its metrics.
    An adapter unloaded since last time loses its residency series: the gauge lists exactly
    the loaded adapters, at most --max-loras of them at 1."""
    names = set()
    for name, _, resident, loads in loras:
        labels = {"role": role, "worker": worker, "adapter": name}
        metrics.lora_resident.labels(**labels).set(1 if resident else 0)
        metrics.advance(metrics.lora_slot_loads, labels, loads)
        names.add(name)
    synced = metrics.lora_synced.setdefault((role, worker), set())
    for gone in synced - names:
        metrics.lora_resident.remove(role, worker, gone)
    synced.clear()
    synced.update(names)


def sync_expert_tokens(metrics: Metrics, role: str, worker: str, counts) -> None:
    """An engine's tokens per expert (EngineStats.expert_tokens: (layer, counts) per MoE layer)."""
    for layer, per_expert in counts:
        for expert, total in enumerate(per_expert):
            metrics.advance(metrics.moe_expert_tokens,
                            {"role": role, "worker": worker, "layer": str(layer), "expert": str(expert)}, total)


def sync_kv_offload(metrics: Metrics, role: str, worker: str, stats) -> None:
    """A worker's offload tiers (engine/kv_offload/stats.py OffloadStats) into its metrics."""
    labels = {"role": role, "worker": worker}
    c, nb = stats.counters, stats.block_nbytes
    totals = []
    for tier in ("host", "disk"):
        t = {**labels, "tier": tier}
        totals += [(metrics.kv_offload_stored_blocks, t, c.stored_blocks[tier]),
                   (metrics.kv_offload_stored_bytes, t, c.stored_blocks[tier] * nb),
                   (metrics.kv_offload_loaded_blocks, t, c.loaded_blocks[tier]),
                   (metrics.kv_offload_loaded_bytes, t, c.loaded_blocks[tier] * nb)]
    totals += [(metrics.kv_offload_lookup_blocks, labels, c.lookup_blocks),
               (metrics.kv_offload_hit_blocks, labels, c.hit_blocks),
               (metrics.kv_offload_failures, {**labels, "kind": "dropped"}, c.dropped_blocks),
               *((metrics.kv_offload_failures, {**labels, "kind": kind}, n) for kind, n in c.disk_failures.items())]
    for counter, counter_labels, total in totals:
        metrics.advance(counter, counter_labels, total)
    for tier, used, capacity in (("host", stats.host_blocks, stats.host_capacity),
                                 ("disk", stats.disk_blocks, stats.disk_capacity)):
        metrics.kv_offload_blocks.labels(**labels, tier=tier, state="used").set(used)
        metrics.kv_offload_blocks.labels(**labels, tier=tier, state="capacity").set(capacity)
    if stats.disk_capacity:
        metrics.kv_offload_tier_up.labels(**labels, tier="disk").set(1 if stats.disk_on else 0)


def exported_metric_names() -> set[str]:
    """Every series name a scrape can contain (histograms/counters expand to their suffixes)."""
    names: set[str] = set()
    for collector in list(Metrics().registry._collector_to_names):  # noqa: SLF001
        for metric in collector.describe() if hasattr(collector, "describe") else collector.collect():
            base = metric.name
            if metric.type == "histogram":
                names.update({f"{base}_bucket", f"{base}_sum", f"{base}_count"})
            elif metric.type == "counter":
                names.update({f"{base}_total", f"{base}_created"})
            else:
                names.add(base)
    return names
