"""Registrations signed with the cluster token (cluster/registration_auth.py): what a
router with the token accepts and refuses, with the message it logs."""

from __future__ import annotations

from dataclasses import replace

from splitserve.cluster.messages import WorkerInfo, decode, encode
from splitserve.cluster.registration_auth import signature_refusal, signed

TOKEN = "the-cluster-token"


def info(**changes) -> WorkerInfo:
    base = WorkerInfo("decode-0", "decode", "10.0.0.7:50052", "llama", 16, 1024, started_at=1700000000.25)
    return replace(base, **changes)


def test_a_signed_registration_is_accepted_also_after_the_bus():
    worker = signed(info(), TOKEN)
    assert len(worker.signature) == 64
    assert signature_refusal(decode(WorkerInfo, encode(worker)), TOKEN) is None
    assert signature_refusal(replace(worker, draining=True), TOKEN) is None  # state, not identity


def test_unsigned_or_foreign_or_altered_registrations_are_refused():
    reason, message = signature_refusal(info(), TOKEN)
    assert reason == "cluster_token"
    assert message == ("worker decode-0 (decode at 10.0.0.7:50052): its registration is not signed; this cluster "
                       "requires its cluster token (start the worker with the same --cluster-token-file as the "
                       "router): refused")
    assert "is signed with another token" in signature_refusal(signed(info(), "another-token"), TOKEN)[1]
    worker = signed(info(), TOKEN)
    for altered in (replace(worker, address="10.0.0.66:50052"), replace(worker, worker_id="decode-9"),
                    replace(worker, role="prefill"), replace(worker, started_at=1700000001.0)):
        assert signature_refusal(altered, TOKEN)[0] == "cluster_token"


def test_without_a_token_nothing_is_signed_or_checked():
    assert signed(info(), None).signature == ""
    assert signature_refusal(info(), None) is None
