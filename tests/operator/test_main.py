"""`splitserve operator` as a real process against the FAKE API server: the CLI
entry point, kopf's liveness endpoint and the operator's /metrics."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import aiohttp
import pytest

from splitserve.operator.main import parse_args

from .fake_kube import FakeKube
from .test_kopf_handlers import IFD, KINDS, NS, child, infd, wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_flags_exit_with_usage():
    with pytest.raises(SystemExit) as exc:
        parse_args(["--resync-seconds", "0"])
    assert exc.value.code == 2
    args = parse_args(["--namespace", "a", "--namespace", "b"])
    assert args.namespace == ["a", "b"]


async def test_operator_process_reconciles_and_serves_metrics(tmp_path, minimal_spec):
    fake = FakeKube(KINDS)
    await fake.start()
    await fake.create_namespace(NS)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        f"apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters: [{{name: fake, cluster: {{server: '{fake.url}'}}}}]\n"
        f"users: [{{name: fake, user: {{token: t}}}}]\n"
        f"contexts: [{{name: fake, context: {{cluster: fake, user: fake}}}}]\n")
    metrics_port, health_port = free_port(), free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "operator", "--namespace", NS, "--resync-seconds", "0.3",
         "--metrics-port", str(metrics_port), "--liveness", f"http://127.0.0.1:{health_port}/healthz",
         "--no-events", "--image", "registry.example/splitserve:cli"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        await fake.create(*IFD, NS, infd("llama", minimal_spec))
        decode = await wait_for(lambda: child(fake, "Deployment", "llama-decode"), "decode Deployment", 60)
        assert decode["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/splitserve:cli"
        async with aiohttp.ClientSession() as http:
            async def scrape(url):
                try:
                    async with http.get(url) as r:
                        return r.status, await r.text()
                except aiohttp.ClientError:
                    return None, ""
            for _ in range(100):
                status, text = await scrape(f"http://127.0.0.1:{metrics_port}/metrics")
                if 'splitserve_operator_replicas{deployment="llama",deployment_namespace="demo",role="decode",state="desired"} 1.0' in text:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"operator metrics never showed the decode replicas: {text[-2000:]}")
            status, _ = await scrape(f"http://127.0.0.1:{health_port}/healthz")
            assert status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = await asyncio.to_thread(proc.communicate, timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        await fake.stop()
    assert proc.returncode == 0, output.decode()[-3000:]
