"""Fixtures of the bench tool's tests."""

from __future__ import annotations

import pytest

from tests.benchmark.bench_fake_server import ScriptedFakeServer, ScriptFn


@pytest.fixture
def fake_server():
    """Factory: fake_server(script_fn) starts a scripted fake server; all stop at teardown."""
    servers: list[ScriptedFakeServer] = []

    def start(script: ScriptFn) -> ScriptedFakeServer:
        server = ScriptedFakeServer(script).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
