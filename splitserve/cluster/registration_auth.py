"""Registrations signed with the cluster token.

On one machine the bus is the router's gRPC bridge, which refuses callers without the
token. In Kubernetes the bus is Redis, which any pod that reaches it (and knows its
password, if any) can write: it could register a fake decode worker and receive users'
prompts. So a worker signs its registration, HMAC-SHA256 over who and where it is with
the cluster token, and a router holding the token routes only to registrations whose
signature verifies: a worker started without the token is refused, as on one machine.
The signature binds the address, so a copied registration still points at the real
worker, which checks the token on every call.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import replace

from splitserve.cluster.messages import WorkerInfo


def _signed_fields(info: WorkerInfo) -> bytes:
    return "\x00".join([info.worker_id, info.role, info.address, info.model, repr(info.started_at)]).encode()


def registration_signature(info: WorkerInfo, token: str) -> str:
    return hmac.new(token.encode(), _signed_fields(info), hashlib.sha256).hexdigest()


def signed(info: WorkerInfo, token: str | None) -> WorkerInfo:
    """The registration with its signature; unchanged without a token."""
    return replace(info, signature=registration_signature(info, token)) if token else info


def signature_refusal(info: WorkerInfo, token: str | None) -> tuple[str, str] | None:
    """(metric reason, message) when a router with a token must not route to `info`."""
    if not token or hmac.compare_digest(info.signature, registration_signature(info, token)):
        return None
    why = "is not signed" if not info.signature else "is signed with another token"
    return "cluster_token", (f"worker {info.worker_id} ({info.role} at {info.address}): its registration {why}; "
                             "this cluster requires its cluster token (start the worker with the same "
                             "--cluster-token-file as the router): refused")
