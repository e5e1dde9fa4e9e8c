"""One version everywhere: the chart's appVersion is the image's tag and the package's
version, and `splitserve --version` says it."""

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

import splitserve

REPO = Path(__file__).resolve().parents[2]


def app_version() -> str:
    return str(yaml.safe_load((REPO / "charts/splitserve/Chart.yaml").read_text())["appVersion"])


def test_package_version_is_the_charts_app_version():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == splitserve.__version__ == app_version()
    assert importlib.metadata.version("splitserve") == app_version()


def test_splitserve_version_prints_it():
    for flag in ("--version", "-V"):
        out = subprocess.run([sys.executable, "-m", "splitserve.cli", flag], capture_output=True, text=True,
                             timeout=60)
        assert (out.returncode, out.stdout, out.stderr) == (0, f"splitserve {app_version()}\n", "")
