"""Shared fixtures: operator settings for fast tests (set before the handlers module
is imported, since kopf reads the timer interval at registration), samples, CRD."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("SPLITSERVE_OPERATOR_RESYNC_SECONDS", "0.3")
os.environ.setdefault("SPLITSERVE_OPERATOR_METRICS_PORT", "0")
os.environ.setdefault("SPLITSERVE_OPERATOR_POST_EVENTS", "false")
os.environ.setdefault("SPLITSERVE_OPERATOR_IMAGE", "registry.example/splitserve:test")
os.environ.setdefault("SPLITSERVE_RAY_VERSION", "2.60.0")

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "charts/splitserve/crds/inferencedeployments.splitserve.io.yaml"
SCHEMAS = REPO.parent / "shared" / "schemas"

MINIMAL_SPEC = {
    "model": {"servedName": "llama-3-8b", "source": {"type": "pvc", "claimName": "models"},
              "path": "llama-3-8b"},
}


@pytest.fixture
def minimal_spec() -> dict:
    return copy.deepcopy(MINIMAL_SPEC)


def load_crd() -> dict:
    return yaml.safe_load(CRD_PATH.read_text())


def crd_schema(crd: dict, version: str | None = None) -> dict:
    for v in crd["spec"]["versions"]:
        if (version is None and v.get("storage")) or v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(version)


def third_party_schema(filename: str, version: str = "v1") -> dict:
    path = SCHEMAS / "crds" / filename
    if not SCHEMAS.is_dir():
        pytest.skip(f"third-party CRD schemas not found at {SCHEMAS} (shared/schemas next to the repo)")
    return crd_schema(yaml.safe_load(path.read_text()), version)


@pytest.fixture
async def cluster(tmp_path, monkeypatch):
    """The fake API server with the operator's real kopf handlers running against it."""
    from .fake_kube import FakeKube
    from .test_kopf_handlers import KINDS, NS, run_operator, stop_operator

    fake = FakeKube(KINDS)
    await fake.start()
    await fake.create_namespace(NS)
    stop, thread = await run_operator(fake, tmp_path, monkeypatch)
    yield fake
    await stop_operator(stop, thread)
    await fake.stop()
