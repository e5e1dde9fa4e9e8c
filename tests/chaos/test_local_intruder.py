"""A process on the same host that speaks splitserve's internal protocols without the
run's cluster token. Before, it could register a fake decode worker on the embedded bus
bridge (and receive half the users' prompts), deregister the real ones, fill every KV
receiver slot and call Generate directly. Each door now answers UNAUTHENTICATED before
any handler runs, and the cluster keeps serving as before."""

from __future__ import annotations

import subprocess
import sys

import grpc
import msgpack
import pytest
import requests

from splitserve.cluster.messages import KVEvent, LoadReport, WorkerInfo, encode
from splitserve.kvtransfer import frames
from splitserve.proto import worker_pb2 as pb
from splitserve.proto import worker_pb2_grpc as pb_grpc
from tests.chaos.conftest import SERVED
from tests.reliability.conftest import metric, prompts

NO_TOKEN = ()
WRONG_TOKEN = (("authorization", "Bearer not-the-cluster-token"),)
CREDENTIALS = [NO_TOKEN, WRONG_TOKEN]
IDS = ["no token", "wrong token"]


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
    assert "cluster token" in info.value.details()
    return info.value


def fake_worker() -> WorkerInfo:
    return WorkerInfo("decode-evil", "decode", "127.0.0.1:1", SERVED, 16, 1 << 20)


@pytest.mark.parametrize("metadata", CREDENTIALS, ids=IDS)
def test_the_bus_bridge_refuses_register_deregister_and_publish(serve, metadata):
    with grpc.insecure_channel(serve.bridge) as channel:
        bus = pb_grpc.BusStub(channel)
        calls = {
            "register": pb.BusCall(method="register", payload=encode(fake_worker()), ttl=6),
            "heartbeat": pb.BusCall(method="heartbeat", payload=encode(fake_worker()), ttl=6),
            "deregister": pb.BusCall(method="deregister", payload=msgpack.packb("decode-0")),
            "publish_load": pb.BusCall(method="publish_load", payload=encode(LoadReport("decode-0", "decode", 0, 0,
                                                                                        0.0)), ttl=6),
            "publish_kv": pb.BusCall(method="publish_kv", payload=encode(KVEvent("decode-0", 1, "cleared", []))),
            "publish_kv_batch": pb.BusCall(method="publish_kv_batch", payload=msgpack.packb(
                [encode(KVEvent("decode-0", 1, "cleared", []))], use_bin_type=True)),
        }
        for request in calls.values():
            refused(lambda request=request: bus.Call(request, timeout=5, metadata=metadata))
    health = serve.router_health()
    assert health["decode_workers"] == ["decode-0", "decode-1"] and health["prefill_workers"] == ["prefill-0"]
    r = requests.post(serve.base_url + "/v1/completions", json={"model": SERVED, "prompt": "still here?",
                                                                  "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and "decode=decode-" in r.headers["X-Splitserve-Route"]


@pytest.mark.parametrize("metadata", CREDENTIALS, ids=IDS)
def test_workers_refuse_generate_prefill_and_health(serve, metadata):
    workers = serve.workers()
    with grpc.insecure_channel(workers["decode-0"].grpc) as channel:
        decode = pb_grpc.DecodeWorkerStub(channel)
        request = pb.GenerateRequest(request_id="evil-1", prompt_token_ids=[5, 6, 7])
        refused(lambda: list(decode.Generate(request, timeout=5, metadata=metadata)))
        refused(lambda: decode.Abort(pb.AbortRequest(request_id="anything"), timeout=5, metadata=metadata))
        refused(lambda: decode.Health(pb.HealthRequest(), timeout=5, metadata=metadata))
    with grpc.insecure_channel(workers["prefill-0"].grpc) as channel:
        prefill = pb_grpc.PrefillWorkerStub(channel)
        refused(lambda: prefill.Prefill(pb.PrefillRequest(request_id="evil-2", prompt_token_ids=[5, 6]), timeout=5,
                                        metadata=metadata))
    assert workers["decode-0"].health()["kv"]["sequences"] == 0


@pytest.mark.parametrize("metadata", CREDENTIALS, ids=IDS)
def test_kv_receivers_refuse_pushes_and_describe(serve, metadata):
    kv = serve.workers()["decode-1"].kv
    with grpc.insecure_channel(kv) as channel:
        refused(lambda: frames.describe_stub(channel)(frames.pb.DescribeRequest(), timeout=5, metadata=metadata))
        # A push opened without credentials never reaches the handler, so it takes no slot.
        for _ in range(20):
            refused(lambda: frames.push_stub(channel)(iter([frames.encode_commit()]), timeout=5, metadata=metadata))
    long_prompt = prompts(700 + len(metadata), 1, 200)[0]  # uncached: goes to the prefill worker
    r = requests.post(serve.base_url + "/v1/completions", json={"model": SERVED, "prompt": long_prompt,
                                                                  "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200
    served = dict(part.split("=", 1) for part in r.headers["X-Splitserve-Workers"].split("; "))
    assert served["prefill"] == "prefill-0", served  # disaggregation still works: the real push got a slot


@pytest.mark.parametrize("flags, reason", [(["--block-size", "32"], "block_size_mismatch"),
                                           (["--served-model-name", "another-model"], "model_mismatch")],
                         ids=["block size", "model"])
def test_a_worker_with_the_token_but_another_block_size_or_model_is_refused(serve, flags, reason):
    """Even holding the token: a worker whose prefix hashes could never match the router's
    (or that serves another model) would take traffic and miss every cache lookup."""
    refused_before = metric(serve.base_url, "splitserve_worker_registrations_refused_total", reason=reason)
    args = ["--model", str(serve.model), "--served-model-name", SERVED, "--num-kv-blocks", "32", "--port", "0",
            "--admin-port", "0", "--drain-port", "0", "--worker-id", "decode-odd",
            "--redis-url", f"grpc://{serve.bridge}", "--cluster-token-file", str(serve.token_file), *flags]
    worker = subprocess.run([sys.executable, "-m", "splitserve.cli", "decode-worker", *args], capture_output=True,
                            text=True, timeout=120)
    assert worker.returncode != 0, worker.stdout[-2000:]
    assert "could not start" in worker.stderr and "refused" in worker.stderr, worker.stderr[-2000:]
    assert "Traceback" not in worker.stderr, worker.stderr[-3000:]
    assert "worker decode-odd (decode at " in serve.log() and "refused" in serve.log()
    assert metric(serve.base_url, "splitserve_worker_registrations_refused_total", reason=reason) == refused_before + 1
    assert serve.router_health()["decode_workers"] == ["decode-0", "decode-1"]
