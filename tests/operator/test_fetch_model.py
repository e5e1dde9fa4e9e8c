"""The init container of `source.type: uri`, for real: the exact command the operator
renders runs `splitserve fetch-model`, i.e. huggingface_hub's snapshot_download,
against a FAKE Hugging Face Hub on 127.0.0.1 (the real Hub cannot be reached here;
huggingface_hub is pointed at the fake with HF_ENDPOINT). The fake serves the three
endpoints a snapshot download uses: revision info, the file tree, and file resolve."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from splitserve.operator.render import Replicas, render_all
from splitserve.operator.spec import parse_spec

COMMIT = "0e9e39f249a16976918f6564b8830bc894c89659"
FILES = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b'{"version": "1.0"}',
         "model-00001-of-00001.safetensors": b"w" * 4096, "pytorch_model.bin": b"b" * 4096,
         "original/consolidated.00.pth": b"p" * 4096}


class FakeHub(BaseHTTPRequestHandler):
    requests: list[tuple[str, str, str | None]] = []

    def _reply(self, body: bytes, headers: dict | None = None) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def do_GET(self):  # noqa: N802 - http.server's naming
        FakeHub.requests.append((self.command, self.path, self.headers.get("Authorization")))
        if self.path.startswith("/api/models/org/llama/revision/"):
            return self._reply(json.dumps({"id": "org/llama", "sha": COMMIT,
                                           "siblings": [{"rfilename": f} for f in FILES]}).encode())
        if self.path.startswith(f"/api/models/org/llama/tree/{COMMIT}"):
            return self._reply(json.dumps([{"type": "file", "path": f, "size": len(d),
                                            "oid": hashlib.sha1(d).hexdigest()} for f, d in FILES.items()]).encode())
        prefix = f"/org/llama/resolve/{COMMIT}/"
        if self.path.startswith(prefix) and self.path[len(prefix):] in FILES:
            data = FILES[self.path[len(prefix):]]
            return self._reply(data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'})
        self.send_response(404)
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def hub():
    FakeHub.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join()


def init_container_args(minimal_spec: dict, kind: str, name: str) -> list[str]:
    spec = {**minimal_spec, "model": {"servedName": "llama", "path": "llama", "source": {
        "type": "uri", "uri": f"hf://org/llama@{COMMIT}", "tokenSecretRef": {"name": "hf", "key": "token"}}}}
    manifests = {(m["kind"], m["metadata"]["name"]): m
                 for m in render_all(parse_spec("q", "ns", spec, "img:1"), Replicas(1, 1), "2.60.0")}
    (init,) = manifests[(kind, name)]["spec"]["template"]["spec"]["initContainers"]
    assert init["command"] == ["splitserve"]
    return init["args"]


def run(args: list[str], hub: str, tmp_path) -> subprocess.CompletedProcess:
    # What the pod gives the init container: HOME=/tmp and HF_TOKEN from the Secret.
    env = {**os.environ, "HF_ENDPOINT": hub, "HF_TOKEN": "hf_secret", "HOME": str(tmp_path / "home")}
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run([sys.executable, "-m", "splitserve.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def downloaded(dest) -> set[str]:
    return {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file() and ".cache" not in p.parts}


def test_decode_init_container_downloads_the_safetensors_with_the_token(hub, tmp_path, minimal_spec):
    args = init_container_args(minimal_spec, "Deployment", "q-decode")
    assert args == ["fetch-model", f"hf://org/llama@{COMMIT}", "/models/llama"]
    dest = tmp_path / "models/llama"
    proc = run([*args[:2], str(dest)], hub, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert downloaded(dest) == {"config.json", "tokenizer.json", "model-00001-of-00001.safetensors"}
    assert (dest / "model-00001-of-00001.safetensors").read_bytes() == FILES["model-00001-of-00001.safetensors"]
    api_calls = [r for r in FakeHub.requests if r[1].startswith(("/api/models", "/org/"))]
    assert api_calls and all(auth == "Bearer hf_secret" for _, _, auth in api_calls)
    # Run again on the same volume (init containers rerun when a pod's sandbox is
    # recreated; its emptyDir stays): no file is fetched again.
    FakeHub.requests = []
    assert run([*args[:2], str(dest)], hub, tmp_path).returncode == 0
    assert not [path for method, path, _ in FakeHub.requests if method == "GET" and "/resolve/" in path]


def test_router_init_container_skips_the_weights(hub, tmp_path, minimal_spec):
    args = init_container_args(minimal_spec, "Deployment", "q-router")
    assert args == ["fetch-model", f"hf://org/llama@{COMMIT}", "/models/llama", "--no-weights"]
    dest = tmp_path / "models/llama"
    proc = run([args[0], args[1], str(dest), *args[3:]], hub, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert downloaded(dest) == {"config.json", "tokenizer.json"}


def test_a_missing_repository_fails_with_one_line(hub, tmp_path):
    proc = run(["fetch-model", "hf://org/missing", str(tmp_path / "m")], hub, tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("splitserve fetch-model: downloading hf://org/missing failed: ")
    assert "tokenSecretRef" in proc.stderr and "Traceback" not in proc.stderr
