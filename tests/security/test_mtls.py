"""Mutual TLS on every gRPC port: a peer without a valid client certificate is refused
(plaintext, TLS without a certificate, a certificate from another CA); with the
cluster's certificate each port answers, and generation works end to end."""

from __future__ import annotations

import grpc
import pytest
import requests

from splitserve.engine import LLM, SamplingParams
from splitserve.kvtransfer import frames
from splitserve.proto.convert import pb
from splitserve.proto.worker_pb2_grpc import BusStub, DecodeWorkerStub, PrefillWorkerStub
from tests.security.conftest import SERVED

PORTS = ["decode", "kv-receiver", "prefill", "bus-bridge"]


async def probe(port: str, address: str, credentials: grpc.ChannelCredentials | None):
    """One harmless call to the port's service; returns the status code (OK if answered)."""
    channel = grpc.aio.insecure_channel(address) if credentials is None else grpc.aio.secure_channel(
        address, credentials)
    async with channel:
        try:
            if port == "decode":
                await DecodeWorkerStub(channel).Health(pb.HealthRequest(), timeout=5)
            elif port == "prefill":
                await PrefillWorkerStub(channel).Health(pb.HealthRequest(), timeout=5)
            elif port == "bus-bridge":
                await BusStub(channel).Call(pb.BusCall(method="heartbeat", payload=b"\x90", ttl=1.0), timeout=5)
            else:
                await channel.unary_unary(frames.DESCRIBE_METHOD, request_serializer=lambda m: m.SerializeToString(),
                                          response_deserializer=lambda b: b)(frames.pb.DescribeRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def creds(files, with_client_cert: bool = True) -> grpc.ChannelCredentials:
    ca = files.ca.read_bytes()
    if not with_client_cert:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(ca, files.key.read_bytes(), files.cert.read_bytes())


@pytest.mark.parametrize("port", PORTS)
def test_every_grpc_port_refuses_peers_without_a_valid_client_certificate(stack, port):
    address = stack.ports()[port]
    refused = {
        "plaintext": None,
        "TLS without a client certificate": creds(stack.certs, with_client_cert=False),
        # trusts our server, but presents a certificate our CA never signed
        "certificate from another CA": grpc.ssl_channel_credentials(
            stack.certs.ca.read_bytes(), stack.impostor.key.read_bytes(), stack.impostor.cert.read_bytes()),
    }
    for what, c in refused.items():
        assert stack.run(probe(port, address, c)) == grpc.StatusCode.UNAVAILABLE, what
    # the cluster's own certificate gets an answer (the bridge rejects the junk payload itself)
    expected = grpc.StatusCode.INVALID_ARGUMENT if port == "bus-bridge" else grpc.StatusCode.OK
    assert stack.run(probe(port, address, creds(stack.certs))) == expected


def test_generation_over_mtls_matches_the_engine(stack, make_ckpt):
    """Both paths (local prefill, and prefill worker -> KV push -> decode worker), over mTLS."""
    long, short = list(range(7, 67)), [11, 12, 13]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(make_ckpt("llama")), num_kv_blocks=96).generate([long, short], params)]
    for prompt, tokens, prefill in ((long, expected[0], "p0"), (short, expected[1], "d0")):
        r = requests.post(stack.base_url + "/v1/completions", headers=stack.auth, timeout=60, json={
            "model": SERVED, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 0})
        assert r.status_code == 200, r.text
        assert dict(p.split("=", 1) for p in r.headers["X-Splitserve-Workers"].split("; "))["prefill"] == prefill
        got = r.json()["choices"][0]
        assert len(got["logprobs"]["tokens"]) == 12
        assert got["text"] == stack.server.tokenizer.decode(tokens)
    stack.wait_all_blocks_free()


def test_tls_flags_need_all_three_files(tmp_path):
    import argparse

    from splitserve.security.tls import add_tls_args, tls_from_args

    ap = argparse.ArgumentParser()
    add_tls_args(ap)
    assert tls_from_args(ap.parse_args([])) is None
    with pytest.raises(SystemExit, match="needs all of --tls-cert, --tls-key and --tls-ca"):
        tls_from_args(ap.parse_args(["--tls-cert", "a.crt"]))
    with pytest.raises(SystemExit, match="--tls-cert .*no such file"):
        tls_from_args(ap.parse_args(["--tls-cert", str(tmp_path / "x"), "--tls-key", "k", "--tls-ca", "c"]))
