"""What the image installs besides torch (scripts/image_requirements.py, run by the Dockerfile)."""

import importlib.util
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("image_requirements", REPO / "scripts/image_requirements.py")
image_requirements = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(image_requirements)

PYPROJECT = {"project": {
    "dependencies": ["torch>=2.4", "transformers>=4.51", "triton>=3.2; platform_system == 'Linux'",
                     "ray[default]>=2.59"],
    "optional-dependencies": {"mooncake": ["mooncake-transfer-engine-non-cuda>=0.3.6"], "test": ["pytest>=8"]},
}}


def test_cpu_leaves_out_torch_and_triton():
    assert image_requirements.image_requirements(PYPROJECT, "cpu") == [
        "transformers>=4.51", "ray[default]>=2.59", "mooncake-transfer-engine-non-cuda>=0.3.6"]


def test_gpu_keeps_triton():
    assert image_requirements.image_requirements(PYPROJECT, "gpu") == [
        "transformers>=4.51", "triton>=3.2; platform_system == 'Linux'", "ray[default]>=2.59",
        "mooncake-transfer-engine-non-cuda>=0.3.6"]


def test_unknown_flavour_is_refused():
    with pytest.raises(ValueError, match="flavour must be cpu or gpu, got 'rocm'"):
        image_requirements.image_requirements(PYPROJECT, "rocm")


def test_every_runtime_dependency_of_the_repository_is_installed():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    wanted = set(pyproject["project"]["dependencies"]) | set(pyproject["project"]["optional-dependencies"]["mooncake"])
    for flavour, left_out in (("cpu", {"torch", "triton"}), ("gpu", {"torch"})):
        got = image_requirements.image_requirements(pyproject, flavour)
        assert {image_requirements.requirement_name(r) for r in wanted - set(got)} == left_out
