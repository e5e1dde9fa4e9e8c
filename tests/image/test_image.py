"""The CPU image, built from the repository's Dockerfile by scripts/build_image.sh (what CI
and the release workflow run), serves a chat request from inside it.

`splitserve serve` runs in the image with `buildah run --isolation chroot` and the host's
network (`podman run` cannot start containers on these machines: cgroups and rlimits), as
the image's own user, on a root filesystem remounted read-only, with writable volumes at
/tmp and /run only: what the chart's restricted securityContext allows (readOnlyRootFilesystem,
an emptyDir at /tmp). The request comes from outside with the openai client.

Needs root (as CI runs): podman's storage in /var/lib/containers and the remount. The first
build on a machine takes 2-5 minutes, later ones seconds (docs/image.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import openai
import pytest
import yaml

from splitserve.core.banner import serving_url
from splitserve.core.model_dir import DEMO_NAME
from tests.helpers.processes import free_port
from tests.suite import image_build

REPO = Path(__file__).resolve().parents[2]
APP_VERSION = str(yaml.safe_load((REPO / "charts/splitserve/Chart.yaml").read_text())["appVersion"])
IMAGE = f"localhost/splitserve:{APP_VERSION}-cpu"
UID = 1000  # what the chart and the operator run pods as (runAsUser / runAsGroup)

# The first test's setup builds the image: a cold build on a busy 2-core machine took 280 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def run(*cmd: str, timeout: float = 120) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return out.stdout


@pytest.fixture(scope="module")
def image() -> str:
    missing = [t for t in ("podman", "buildah", "mmdebstrap") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (scripts/setup.sh installs them with apt)")
    assert os.geteuid() == 0, "the image test runs as root, as CI does (podman's storage, the remount)"
    # Started in the background at collection when the session runs more than this module
    # (tests/suite/image_build.py); built here otherwise.
    rc, output = image_build.wait_or_build(IMAGE, timeout=1400)
    assert rc == 0, f"image build failed (exit {rc}):\n{output}"
    return IMAGE


@contextlib.contextmanager
def working_container(image: str):
    """A buildah working container of the image and the host path of its root filesystem."""
    name = run("buildah", "from", "--quiet", "--name", f"splitserve-test-{os.getpid()}", image).strip()
    try:
        yield name, run("buildah", "mount", name).strip()
    finally:
        run("buildah", "rm", name)


def in_image(container: str, *cmd: str) -> str:
    return run("buildah", "run", "--isolation", "chroot", "--network", "host", container, "--", *cmd)


def test_image_runs_as_its_non_root_user_and_reports_the_chart_version(image):
    config = json.loads(run("buildah", "inspect", "--type", "image", image))["OCIv1"]["config"]
    assert config["User"] == f"{UID}:{UID}"
    assert config["Labels"]["org.opencontainers.image.version"] == APP_VERSION
    assert "HOME=/tmp" in config["Env"]
    with working_container(image) as (container, _):
        assert in_image(container, "id", "-u").strip() == str(UID)
        assert in_image(container, "splitserve", "--version").strip() == f"splitserve {APP_VERSION}"
        # What the pods run besides `splitserve`: the operator's Ray pods run `ray start` and
        # the prefill pool through /bin/bash; KubeRay's probes use wget.
        assert in_image(container, "sh", "-c", "ls /bin/bash; command -v ray; command -v wget").split() == [
            "/bin/bash", "/opt/splitserve/bin/ray", "/usr/bin/wget"]


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def ids(pid: int, field: str) -> set[int]:
    """The real, effective, saved and filesystem ids of a process ("Uid" or "Gid")."""
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith(field + ":"))
    return {int(v) for v in line.split()[1:]}


def root_mount_options(pid: int) -> list[str]:
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == "/":
            return fields[5].split(",")
    raise AssertionError(f"no root mount in /proc/{pid}/mountinfo")


class ServeInImage:
    """`splitserve serve` inside the image; ready when it prints its URL."""

    def __init__(self, container: str, tmp: Path, run_dir: Path, timeout: float = 300):
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["buildah", "run", "--isolation", "chroot", "--network", "host", "--volume", f"{tmp}:/tmp",
             "--volume", f"{run_dir}:/run", container, "--",
             "splitserve", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                if serving_url(line):
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout)
        if self.proc.poll() is not None or not any(serving_url(ln) for ln in self.lines):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError("serve did not start in the image:\n" + self.log())

    def log(self) -> str:
        return "".join(self.lines[-80:])

    def processes(self) -> list[int]:
        """The processes inside the image: descendants of `buildah run` chrooted into it."""
        inside = []
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/root") != "/":
                    inside.append(pid)
        return inside

    def serve_pid(self) -> int:
        for pid in self.processes():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                # python running the console script (buildah-chroot-exec has the same args)
                if argv[0].endswith(b"python3") and argv[1:3] == [b"/opt/splitserve/bin/splitserve", b"serve"]:
                    return pid
        raise AssertionError("no `splitserve serve` process inside the image:\n" + self.log())

    def stop(self) -> int:
        if self.proc.poll() is None:
            with contextlib.suppress(AssertionError, ProcessLookupError):
                os.kill(self.serve_pid(), signal.SIGINT)  # Ctrl-C: serve stops Ray and its workers
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def test_serves_a_chat_request_from_a_read_only_root_as_non_root(image, tmp_path):
    tmp, run_dir = tmp_path / "tmp", tmp_path / "run"
    tmp.mkdir()
    run_dir.mkdir()
    os.chown(tmp, UID, UID)  # an emptyDir with fsGroup: writable by the pod's user
    with working_container(image) as (container, rootfs):
        # A read-only root like readOnlyRootFilesystem. buildah writes its own mount points
        # (/etc/hosts, /run/.containerenv) before the command runs (/run is a volume here for
        # that) and removes them after it ends, so the root goes back to read-write before stop.
        run("mount", "-o", "remount,ro", rootfs)
        serve, code = None, None
        try:
            serve = ServeInImage(container, tmp, run_dir)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve.port}/v1", api_key="unused", max_retries=0)
            assert [m.id for m in client.models.list().data] == [DEMO_NAME]
            reply = client.chat.completions.create(
                model=DEMO_NAME, messages=[{"role": "user", "content": "Hello from outside the image"}],
                max_tokens=8, temperature=0)
            choice = reply.choices[0]
            assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
            assert choice.finish_reason in ("length", "stop") and 1 <= reply.usage.completion_tokens <= 8

            seen = {}  # pid -> (uids, gids, root mount read-only); a process may end meanwhile
            for pid in serve.processes():
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    seen[pid] = (ids(pid, "Uid"), ids(pid, "Gid"), "ro" in root_mount_options(pid))
            assert serve.serve_pid() in seen and len(seen) > 3, serve.log()  # serve, Ray, the workers
            assert {pid: info for pid, info in seen.items() if info != ({UID}, {UID}, True)} == {}
            # Everything written went to /tmp: the demo checkpoint in the image's cache dir.
            demo = tmp / "cache" / "splitserve" / DEMO_NAME / "config.json"
            assert demo.is_file() and demo.stat().st_uid == UID
            # The native decode attention was compiled there for this CPU (the image has g++).
            assert list((tmp / "cache" / "splitserve" / "kernels").glob("splitserve_cpu-*.so")), serve.log()
            assert "native CPU decode attention unavailable" not in serve.log()
        finally:
            run("mount", "-o", "remount,rw", rootfs)
            if serve is not None:
                code = serve.stop()
    assert code == 0 and "splitserve: shutting down" in serve.log(), serve.log()
