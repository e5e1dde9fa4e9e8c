import os

import pytest

# Keep tests on the CPU reference kernels unless a test forces Triton itself.
os.environ.setdefault("SPLITSERVE_KERNELS", "auto")
# Triton picks interpreter-or-GPU mode once, at first import (transformers imports it):
# without a GPU, choose the interpreter before anything can import triton.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# openai-harmony (gpt-oss's chat format) cannot download o200k_base.tiktoken here: give it the
# verified copy rebuilt from quicktok-v1 (splitserve/core/harmony_vocab.py); `serve` inherits it.
try:
    from splitserve.core.harmony_vocab import VocabUnavailable, use_offline_vocab

    use_offline_vocab()
except VocabUnavailable:
    pass  # the harmony tests fail with the reason; nothing else needs it


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def make_ckpt(checkpoint_root):
    from tests.helpers.checkpoints import make_checkpoint

    def make(family: str = "llama", **overrides):
        return make_checkpoint(checkpoint_root, family, **overrides)

    return make


@pytest.fixture(scope="session")
def shared_serve(make_ckpt):
    """shared_serve(layout): the session's `splitserve serve` for a layout of
    tests/helpers/shared_serve.py, started on first use."""
    from tests.helpers.shared_serve import SharedServes

    serves = SharedServes(make_ckpt)
    yield serves.get
    problems = serves.stop_all()
    assert not problems, problems


@pytest.fixture(scope="module", autouse=True)
def no_tensor_parallel_group_left(request):
    """A module that leaves this process's tensor-parallel group up (an engine never closed)
    fails here, by name; the group is then dropped, so the later modules of this xdist worker
    do not all fail with "a single-process engine cannot start in a process that runs a
    tensor-parallel engine". Module scope: a module's own TP engine fixture may span its tests."""
    import sys

    yield
    state = sys.modules.get("splitserve.engine.parallel.state")
    if state is not None and state.tp().size > 1:
        state.destroy_tensor_parallel()
        pytest.fail(f"{request.module.__name__} left a tensor-parallel engine running (close it: "
                    "`with LLM(...)` or llm.close())")


# --- the suite's shape (docs/testing.md): parallel units, their order, the budget -----------

def pytest_configure(config):
    from tests.suite import budget, image_build

    image_build.build_dir()  # before xdist starts its workers: they inherit the directory
    budget.register(config)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:  # an xdist worker: torch gets this worker's share of the CPUs, not all of them
        import torch

        from tests.suite.plan import torch_threads_per_worker

        torch.set_num_threads(torch_threads_per_worker(len(os.sched_getaffinity(0)), workers))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks added here
def pytest_collection_modifyitems(config, items):
    from tests.suite import plan

    for item in items:
        if plan.is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    by_id = {item.nodeid: item for item in items}
    items[:] = [by_id[n] for n in plan.order(list(by_id), plan.load_module_seconds())]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole units to one worker (tests/suite/plan.py), in the collection order set above.
    xdist's own loadgroup marks do not work with pytest 9 (it rewrites a node id field that
    pytest 9 no longer reads: every test became its own unit), so the scheduler is told."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    from tests.suite import plan

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return plan.unit_of(nodeid)

    return UnitScheduling(config, log)


def pytest_collection_finish(session):
    """Start the image build now if tests/image will run (once per session, whichever
    process gets here first), so its network waits overlap the rest of the suite."""
    from tests.suite import image_build

    if session.config.option.collectonly:
        return
    if any(item.nodeid.startswith("tests/image/") for item in session.items):
        from tests.image.test_image import IMAGE

        image_build.start_in_background(IMAGE)


def pytest_unconfigure(config):
    from tests.suite import image_build

    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        image_build.stop_if_running()
