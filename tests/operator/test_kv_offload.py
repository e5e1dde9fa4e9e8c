"""spec.<role>.kvOffload: the workers of each role get the tier flags, a disk tier gets its
volume (an emptyDir sized above the tier, or the named claim) mounted at /kv-offload on the
pods that run the engines; the CRD and the operator refuse the same bad values."""

from __future__ import annotations

import copy

import pytest

from splitserve.engine.kv_offload.args import kv_offload_problem
from splitserve.operator.render import Replicas, render_all
from splitserve.operator.spec import SpecError, parse_spec

from .conftest import crd_schema, load_crd
from .crd_values import admit
from .test_kv_cache_dtype import worker_commands

DISK = {"hostGiB": 8, "disk": {"sizeGiB": 100}}
PVC = {"disk": {"sizeGiB": 50, "volume": "pvc", "claimName": "kv-cache"}}


def with_offload(spec: dict, role: str, offload) -> dict:
    out = copy.deepcopy(spec)
    out.setdefault(role, {})["kvOffload"] = offload
    return out


def pods(spec) -> dict[str, dict]:
    """Role -> the pod spec that runs its engines (decode Deployment, prefill Ray workers)."""
    out = {}
    for m in render_all(spec, Replicas(1, 1), "2.60.0"):
        if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-decode"):
            out["decode"] = m["spec"]["template"]["spec"]
        if m["kind"] == "RayCluster":
            out["prefill"] = m["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    return out


def test_no_kv_offload_renders_no_flag_and_no_volume(minimal_spec):
    spec = parse_spec("x", "ns", minimal_spec, "img:1")
    assert not any("--kv-offload" in c for c in worker_commands(spec).values())
    assert not any(v["name"] == "kv-offload" for p in pods(spec).values() for v in p["volumes"])


def test_decode_tiers_reach_the_decode_workers_with_an_empty_dir(minimal_spec):
    spec = parse_spec("x", "ns", with_offload(minimal_spec, "decode", DISK), "img:1")
    commands = worker_commands(spec)
    assert "--kv-offload-gib 8 --kv-offload-dir /kv-offload --kv-offload-dir-gib 100" in commands["decode"]
    assert "--kv-offload" not in commands["prefill"]
    decode = pods(spec)["decode"]
    assert {"name": "kv-offload", "emptyDir": {"sizeLimit": "107776Mi"}} in decode["volumes"]  # 100 GiB + 5% + 256 Mi
    assert {"name": "kv-offload", "mountPath": "/kv-offload"} in decode["containers"][0]["volumeMounts"]
    assert not any(v["name"] == "kv-offload" for v in pods(spec)["prefill"]["volumes"])
    args = commands["decode"].split(" ")  # and the worker's own check takes them
    flags = {"kv_offload_gib": 8.0, "kv_offload_dir": args[args.index("--kv-offload-dir") + 1],
             "kv_offload_dir_gib": float(args[args.index("--kv-offload-dir-gib") + 1])}
    assert kv_offload_problem(type("Args", (), flags)()) is None


def test_a_prefill_disk_tier_on_a_claim_is_mounted_on_the_ray_workers(minimal_spec):
    spec = parse_spec("x", "ns", with_offload(minimal_spec, "prefill", PVC), "img:1")
    assert "--kv-offload-dir /kv-offload --kv-offload-dir-gib 50" in worker_commands(spec)["prefill"]
    worker = pods(spec)["prefill"]
    assert {"name": "kv-offload", "persistentVolumeClaim": {"claimName": "kv-cache"}} in worker["volumes"]
    assert {"name": "kv-offload", "mountPath": "/kv-offload"} in worker["containers"][0]["volumeMounts"]


@pytest.mark.parametrize("offload, message", [
    ({"disk": {"sizeGiB": 10, "volume": "pvc"}}, "kvOffload.disk.claimName is required with volume pvc"),
    ({"disk": {"sizeGiB": 0}}, "kvOffload.disk.sizeGiB must be > 0"),
    ({"hostGiB": -1}, "hostGiB must be >= 0"),
])
def test_the_crd_and_the_operator_refuse_the_same_bad_values(minimal_spec, offload, message):
    with pytest.raises(SpecError, match=message.split(": ")[-1].split(" must")[0]):
        parse_spec("x", "ns", with_offload(minimal_spec, "decode", offload), "img:1")
    obj = {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "x", "namespace": "ns"}, "spec": with_offload(minimal_spec, "decode", offload)}
    _, errors = admit(crd_schema(load_crd(), "v1alpha1"), obj)
    assert errors, offload
    assert any("hostGiB" in e or message in e for e in errors), errors


def test_a_valid_offload_is_admitted_with_its_default_volume(minimal_spec):
    obj = {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "x", "namespace": "ns"}, "spec": with_offload(minimal_spec, "decode", DISK)}
    stored, errors = admit(crd_schema(load_crd(), "v1alpha1"), obj)
    assert errors == []
    assert stored["spec"]["decode"]["kvOffload"]["disk"]["volume"] == "emptyDir"


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_the_worker_cli_accepts_the_rendered_tier_flags(minimal_spec, role):
    """The real CLI parses them and passes its own check, stopping at the model (absent here)."""
    import shlex
    import subprocess
    import sys

    offload = {"hostGiB": 2, "disk": {"sizeGiB": 10}}
    command = worker_commands(parse_spec("x", "ns", with_offload(minimal_spec, role, offload), "img:1"))[role]
    if role == "prefill":
        command = command.split("exec splitserve ", 1)[1].replace('"$SPLITSERVE_REDIS_URL"', "redis://127.0.0.1:1/0")
    args = [a.replace("$(SPLITSERVE_REDIS_URL)", "redis://127.0.0.1:1/0") for a in shlex.split(command)]
    assert "--kv-offload-dir-gib" in args
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 2 and "kv-offload" not in proc.stderr, proc.stderr[-2000:]
    assert "config.json not found" in proc.stderr + proc.stdout, proc.stderr[-2000:]
