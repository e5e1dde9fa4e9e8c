"""Fixtures: a real `redis-server` on a free 127.0.0.1 port, and `bus`, which runs each
test once on Redis and once on the in-process bus."""

import shutil
import socket
import subprocess
import time
import uuid

import pytest
import redis

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.cluster.redis_bus import RedisBus


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run scripts/setup.sh (apt install redis-server)")
    workdir = tmp_path_factory.mktemp("redis")
    for _ in range(5):  # another process may grab the port between probe and bind
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        if proc.poll() is None:
            break
    else:
        pytest.fail("could not start redis-server on a free port")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(params=["inproc", "redis"])
async def bus_factory(request):
    """Makes buses on one shared backend: several routers/workers of one test see the
    same cluster (a fresh cluster name per test keeps tests apart on one Redis)."""
    cluster = f"t{uuid.uuid4().hex[:8]}"
    made = []
    if request.param == "inproc":
        shared = InProcBus(cluster)

        def make():
            return shared
    else:
        url = request.getfixturevalue("redis_url")

        def make():
            made.append(RedisBus(url, cluster))
            return made[-1]

    make.kind = request.param
    yield make
    for b in made:
        await b.close()


@pytest.fixture
def bus(bus_factory):
    return bus_factory()
