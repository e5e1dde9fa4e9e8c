import os

import pytest

# Keep tests on the CPU reference kernels unless a test forces Triton itself.
os.environ.setdefault("SPLITSERVE_KERNELS", "auto")
# Triton picks interpreter-or-GPU mode once, at first import (transformers imports it):
# without a GPU, choose the interpreter before anything can import triton.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def make_ckpt(checkpoint_root):
    from tests.helpers.checkpoints import make_checkpoint

    def make(family: str = "llama", **overrides):
        return make_checkpoint(checkpoint_root, family, **overrides)

    return make
