"""The structure cannot silently decay: layers point down only (import-linter's contracts in
pyproject.toml), and the router and the operator run without the model runtime."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["splitserve.router", "splitserve.operator", "splitserve.cluster", "splitserve.core"]
RUNTIME = ["torch", "transformers", "triton", "safetensors", "ray", "splitserve.engine", "splitserve.kernels"]


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout, result.stdout[-2000:]


def test_router_and_operator_modules_import_without_the_model_runtime():
    """Every module of these packages, imported in a fresh interpreter."""
    code = f"""
import importlib, pkgutil, sys
names = []
for package in {PACKAGES!r}:
    pkg = importlib.import_module(package)
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, package + ".")]
for name in names:
    importlib.import_module(name)
loaded = sorted(m for m in {RUNTIME!r} if m in sys.modules)
print(len(names), "modules;", "runtime loaded:", loaded)
sys.exit(1 if loaded else 0)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert int(result.stdout.split()[0]) >= 40, result.stdout  # every module was found and imported
