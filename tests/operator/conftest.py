"""Shared fixtures: operator settings for fast tests (set before the handlers module
is imported, since kopf reads the timer interval at registration), samples, CRD."""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import jsonschema
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


# libyaml's loader where PyYAML has it: the same YAML, ~10x faster on the 0.9 MB RayCluster CRD
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=4)
def _parsed(text: str) -> dict:
    return yaml.load(text, Loader=_LOADER)


def load_crd() -> dict:
    """The chart's CRD as it is on disk now (parsed once per content; a copy callers may change)."""
    return copy.deepcopy(_parsed(CRD_PATH.read_text()))


def crd_schema(crd: dict, version: str | None = None) -> dict:
    for v in crd["spec"]["versions"]:
        if (version is None and v.get("storage")) or v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(version)


def third_party_schema(filename: str, version: str = "v1") -> dict:
    if not SCHEMAS.is_dir():
        pytest.skip(f"third-party CRD schemas not found at {SCHEMAS} (shared/schemas next to the repo)")
    return copy.deepcopy(_third_party_schema(filename, version))


@functools.cache
def _third_party_schema(filename: str, version: str) -> dict:
    return crd_schema(yaml.load((SCHEMAS / "crds" / filename).read_text(), Loader=_LOADER), version)


def checked_validator(schema: dict):
    """jsonschema.validate(instance, schema) as a function of the instance, with the schema
    checked against its metaschema once here instead of on every call (on the CRDs that
    check costs seconds): the same best-matching ValidationError for an invalid instance."""
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator = cls(schema)

    def validate(instance) -> None:
        error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
        if error is not None:
            raise error

    return validate


def third_party_validator(filename: str, version: str = "v1"):
    """checked_validator of a third-party CRD's schema, built once per session."""
    if not SCHEMAS.is_dir():
        pytest.skip(f"third-party CRD schemas not found at {SCHEMAS} (shared/schemas next to the repo)")
    return _third_party_validator(filename, version)


@functools.cache
def _third_party_validator(filename: str, version: str):
    return checked_validator(_third_party_schema(filename, version))


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
