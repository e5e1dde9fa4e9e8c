"""Malformed and hostile gRPC messages to every worker port, sent by a peer that holds a
valid certificate (the worst case mTLS allows): garbage bytes, and well-formed messages
whose fields hypothesis fills with anything (out-of-vocabulary and huge token ids,
NaN/inf sampling values, foreign block ids, unreachable addresses, junk bus payloads).

Each is rejected with a status code, never an unhandled error (gRPC's UNKNOWN) from
our handlers; garbage that does not parse is refused by gRPC before any handler runs.
Afterwards every worker answers Health, holds no request and has every block free."""

from __future__ import annotations

import math

import grpc
import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.kvtransfer import frames
from splitserve.proto.convert import pb
from splitserve.proto.worker_pb2_grpc import DecodeWorkerStub, PrefillWorkerStub

EXAMPLES = 150
FUZZ = dict(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
REJECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED,
            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}

METHODS = {  # full method name -> (kind, port)
    "/splitserve.worker.DecodeWorker/Generate": ("unary_stream", "decode"),
    "/splitserve.worker.DecodeWorker/Abort": ("unary_unary", "decode"),
    "/splitserve.worker.DecodeWorker/Health": ("unary_unary", "decode"),
    "/splitserve.worker.PrefillWorker/Prefill": ("unary_unary", "prefill"),
    "/splitserve.worker.PrefillWorker/Health": ("unary_unary", "prefill"),
    "/splitserve.worker.Bus/Call": ("unary_unary", "bus-bridge"),
    frames.DESCRIBE_METHOD: ("unary_unary", "kv-receiver"),
    frames.PUSH_METHOD: ("stream_unary", "kv-receiver"),
}

u32 = st.integers(0, 2**32 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
hostile_sampling = st.builds(
    pb.Sampling, temperature=floats, top_p=floats, top_k=st.integers(-2**31, 2**31 - 1), min_p=floats,
    has_seed=st.booleans(), seed=st.integers(-2**63, 2**63 - 1), max_tokens=st.integers(-5, 4),
    stop=st.lists(st.text(max_size=4), max_size=3), stop_token_ids=st.lists(u32, max_size=3),
    ignore_eos=st.booleans(), logprobs=st.integers(-3, 30), skip_special_tokens=st.booleans())
valid_sampling = st.builds(  # valid, so that requests get past validation into the engine
    pb.Sampling, temperature=st.floats(0, 2), top_p=st.floats(0.01, 1), top_k=st.sampled_from([-1, 1, 5]),
    min_p=st.floats(0, 1), has_seed=st.booleans(), seed=st.integers(-2**63, 2**63 - 1),
    max_tokens=st.integers(1, 4), stop_token_ids=st.lists(st.integers(0, 600), max_size=3),
    ignore_eos=st.booleans(), logprobs=st.integers(-1, 5), skip_special_tokens=st.booleans())
samplings = st.one_of(valid_sampling, hostile_sampling)
token_lists = st.one_of(st.lists(st.integers(0, 600), max_size=60), st.lists(st.one_of(st.integers(0, 600), u32),
                                                                               max_size=80))
request_ids = st.one_of(st.just(""), st.text(min_size=1, max_size=12), st.just("fuzz"))


class Peer:
    """A certified client of the stack's four ports."""

    def __init__(self, stack):
        self.stack = stack
        creds = grpc.ssl_channel_credentials(stack.certs.ca.read_bytes(), stack.certs.key.read_bytes(),
                                             stack.certs.cert.read_bytes())
        self.channels = {name: grpc.secure_channel(addr, creds) for name, addr in stack.ports().items()}
        self.codes: dict[str, int] = {}  # status code name -> calls

    def call(self, method: str, payload: bytes | list[bytes]) -> tuple[grpc.StatusCode, str]:
        kind, port = METHODS[method]
        fn = getattr(self.channels[port], kind)(method, request_serializer=lambda b: b,
                                                response_deserializer=lambda b: b)
        try:
            if kind == "unary_stream":
                list(fn(payload, timeout=30))
            elif kind == "stream_unary":
                fn(iter(payload), timeout=30)
            else:
                fn(payload, timeout=30)
        except grpc.RpcError as exc:
            self.codes[exc.code().name] = self.codes.get(exc.code().name, 0) + 1
            return exc.code(), exc.details() or ""
        self.codes["OK"] = self.codes.get("OK", 0) + 1
        return grpc.StatusCode.OK, ""

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()


def parse_refused(code: grpc.StatusCode, details: str) -> bool:
    """gRPC's own refusal of bytes that do not parse, before any handler runs (the aio
    server says UNKNOWN, the threaded one INTERNAL)."""
    return ((code == grpc.StatusCode.UNKNOWN and "Error parsing message" in details)
            or (code == grpc.StatusCode.INTERNAL and details == "Exception deserializing request!"))


def assert_rejected_or_served(code: grpc.StatusCode, details: str, what) -> None:
    assert code == grpc.StatusCode.OK or code in REJECTED, (what, code, details)


def test_garbage_bytes_to_every_method(stack):
    peer = Peer(stack)

    @settings(**{**FUZZ, "max_examples": EXAMPLES * 2})
    @given(method=st.sampled_from(sorted(METHODS)), raw=st.binary(max_size=200))
    def fuzz(method, raw):
        code, details = peer.call(method, [raw] if METHODS[method][0] == "stream_unary" else raw)
        if parse_refused(code, details):
            pass
        elif method == frames.PUSH_METHOD:  # the KV receiver answers every stream with a PushAck
            assert code == grpc.StatusCode.OK, (raw, code, details)
        else:
            assert_rejected_or_served(code, details, (method, raw))

    try:
        fuzz()
    finally:
        peer.close()
    assert_unharmed(stack)


def test_hostile_well_formed_messages(stack):
    peer = Peer(stack)
    decode_kv, prefill_addr = stack.decode.kv_address, stack.prefill.address
    addresses = st.sampled_from(["", "127.0.0.1:1", "not an address", prefill_addr, decode_kv])

    # Every field is hostile half the time or less, so that a share of the requests reaches the
    # engine: a resume as long as max_tokens (1-4 here) is refused, so resumes are often empty.
    @settings(**FUZZ)
    @given(rid=st.one_of(st.just("fuzz-ok"), request_ids),
           prompt=st.one_of(st.lists(st.integers(0, 600), min_size=1, max_size=60), token_lists),
           resume=st.one_of(st.just([]), st.just([]), token_lists), sampling=st.one_of(valid_sampling, valid_sampling, samplings),
           prefill=addresses)
    def generate(rid, prompt, resume, sampling, prefill):
        msg = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                 resume_token_ids=resume, prefill_address=prefill, prefill_worker_id="p0")
        code, details = peer.call("/splitserve.worker.DecodeWorker/Generate", msg.SerializeToString())
        assert_rejected_or_served(code, details, msg)

    @settings(**FUZZ)
    @given(rid=request_ids, prompt=token_lists, sampling=samplings, receiver=addresses,
           backend=st.sampled_from(["grpc", "mooncake", "", "x"]), skip=u32,
           dest=st.lists(st.one_of(st.integers(0, 95), u32), max_size=8),
           timeout=st.floats(allow_nan=True, allow_infinity=True))
    def prefill(rid, prompt, sampling, receiver, backend, skip, dest, timeout):
        msg = pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                kv_receiver_address=receiver, kv_backend=backend, skip_blocks=skip,
                                dest_block_ids=dest, timeout_s=timeout if math.isnan(timeout) else
                                max(-1.0, min(timeout, 3.0)))
        code, details = peer.call("/splitserve.worker.PrefillWorker/Prefill", msg.SerializeToString())
        assert_rejected_or_served(code, details, msg)

    values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(max_size=6),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner,
                                                                                     max_size=8), max_leaves=10)
    fields = st.fixed_dictionaries({}, optional={k: values for k in (
        "worker_id", "role", "address", "model", "block_size", "num_kv_blocks", "event_id", "kind",
        "block_hashes", "parent", "waiting", "running", "kv_usage")})

    @settings(**FUZZ)
    @given(method=st.sampled_from(["register", "heartbeat", "deregister", "publish_load", "publish_kv", "publish_kv_batch", "", "x"]),
           payload=st.one_of(values, fields).map(msgpack.packb), ttl=st.floats(allow_nan=True))
    def bus(method, payload, ttl):
        code, details = peer.call("/splitserve.worker.Bus/Call",
                                  pb.BusCall(method=method, payload=payload, ttl=ttl).SerializeToString())
        assert_rejected_or_served(code, details, (method, payload, ttl))

    try:
        generate()
        generated = peer.codes.get("OK", 0)
        prefill()
        bus()
    finally:
        peer.close()
    print(f"hostile gRPC messages: {peer.codes}; generations served: {generated}")
    # Not vacuous: some generations got past validation into the engine. How many varies with
    # hypothesis's draws (17-56 of 150 in 20 runs; the old floor of 15 failed once at 14), so the
    # floor only tells a fuzz that reaches the engine from one that never does.
    assert sum(peer.codes.values()) >= 3 * EXAMPLES and generated >= 3
    assert_unharmed(stack)
    # nothing a peer sent put a fake worker into the router's view
    assert sorted(stack.server.dispatcher.sync.workers) == ["d0", "p0"] or stack.run(_refreshed(stack)) == [
        "d0", "p0"]


async def _refreshed(stack) -> list[str]:
    await stack.server.dispatcher.sync.refresh()
    return sorted(stack.server.dispatcher.sync.workers)


def assert_unharmed(stack) -> None:
    stack.wait_all_blocks_free()
    d = stack.run(_health(stack))
    assert d == ("d0", "p0")


async def _health(stack):
    creds = grpc.ssl_channel_credentials(stack.certs.ca.read_bytes(), stack.certs.key.read_bytes(),
                                         stack.certs.cert.read_bytes())
    async with grpc.aio.secure_channel(stack.decode.address, creds) as a, \
            grpc.aio.secure_channel(stack.prefill.address, creds) as b:
        d = await DecodeWorkerStub(a).Health(pb.HealthRequest(), timeout=10)
        p = await PrefillWorkerStub(b).Health(pb.HealthRequest(), timeout=10)
    return d.worker_id, p.worker_id
