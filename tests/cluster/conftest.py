"""Fixtures: a real `redis-server` on a free 127.0.0.1 port, and `bus`, which runs each
test once on Redis and once on the in-process bus."""

import uuid

import pytest

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.cluster.redis_bus import RedisBus
from tests.helpers.processes import start_redis


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    url, proc = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
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
