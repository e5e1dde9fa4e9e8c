"""How one process's gRPC links authenticate: mutual TLS, a cluster token, both or neither.

Every gRPC server (decode/prefill worker, KV receiver, embedded bus bridge) and every
channel to one is made here, so no link can be left out:
- mutual TLS (`TLSConfig`): peers must hold a certificate of the cluster CA, and traffic
  is encrypted;
- a cluster token: every call carries `authorization: Bearer <token>` and servers refuse
  calls without it (UNAUTHENTICATED) before any handler runs, compared in constant time.
  `splitserve serve` generates one per run, so no other process on the host can register
  a worker, push KV blocks or call Generate. It does not encrypt: across machines use
  mutual TLS too.
Clients pass `metadata=security.metadata` on each call (cheaper than a client interceptor
on the token-streaming path; a forgotten one fails loudly with UNAUTHENTICATED).
"""

from __future__ import annotations

import argparse
import hmac
import os
import secrets
from dataclasses import dataclass

import grpc

from splitserve.security.tls import TLSConfig, add_tls_args, tls_from_args

TOKEN_KEY = "authorization"
UNAUTHENTICATED = ("this splitserve cluster requires its cluster token (authorization: Bearer ...); "
                   "the caller did not present it")


@dataclass(frozen=True)
class LinkSecurity:
    tls: TLSConfig | None = None
    token: str | None = None

    @classmethod
    def generate(cls, tls: TLSConfig | None = None) -> LinkSecurity:
        """A fresh random cluster token (one `splitserve serve` run)."""
        return cls(tls, secrets.token_urlsafe(32))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_KEY, f"Bearer {self.token}"),) if self.token else ()

    def describe(self) -> str:
        parts = (["mTLS"] if self.tls else []) + (["cluster token"] if self.token else [])
        return " + ".join(parts) or "unauthenticated"

    # ---- servers ------------------------------------------------------------------------
    def aio_server(self, **kwargs) -> grpc.aio.Server:
        interceptors = [_AioTokenCheck(self.token)] if self.token else []
        return grpc.aio.server(interceptors=interceptors, **kwargs)

    def sync_server(self, executor, **kwargs) -> grpc.Server:
        interceptors = [_SyncTokenCheck(self.token)] if self.token else []
        return grpc.server(executor, interceptors=interceptors, **kwargs)

    def add_port(self, server, address: str) -> int:
        """Bind `address` (with mTLS when configured); 0 when it could not be bound."""
        if self.tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.tls.server_credentials())

    # ---- channels -----------------------------------------------------------------------
    def aio_channel(self, address: str, options: list | None = None) -> grpc.aio.Channel:
        options = list(options or [])
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self.tls.channel_credentials(),
                                       options=options + self.tls.channel_options())

    def sync_channel(self, address: str, options: list | None = None) -> grpc.Channel:
        options = list(options or [])
        if self.tls is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, self.tls.channel_credentials(), options=options + self.tls.channel_options())


NO_SECURITY = LinkSecurity()


def token_matches(metadata, token: str) -> bool:
    expected = f"Bearer {token}".encode()
    for key, value in metadata or ():
        if key == TOKEN_KEY:
            given = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else bytes(value)
            return hmac.compare_digest(given, expected)
    return False


def _denying_handler(handler: grpc.RpcMethodHandler | None, deny):
    """A handler of the same kind as `handler` that only refuses the call."""
    if handler is None:
        return None
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny, **kw)


class _AioTokenCheck(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self.token = token

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if token_matches(details.invocation_metadata, self.token):
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

        return _denying_handler(handler, deny)


class _SyncTokenCheck(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self.token = token

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if token_matches(details.invocation_metadata, self.token):
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

        return _denying_handler(handler, deny)


# ---- command line ---------------------------------------------------------------------
def add_security_args(ap: argparse.ArgumentParser) -> None:
    add_tls_args(ap)
    ap.add_argument("--cluster-token-file", default=os.environ.get("SPLITSERVE_CLUSTER_TOKEN_FILE"),
                    help="file holding the cluster token every gRPC link must present (default: "
                         "$SPLITSERVE_CLUSTER_TOKEN_FILE, else $SPLITSERVE_CLUSTER_TOKEN, else none)")


def security_from_args(args: argparse.Namespace) -> LinkSecurity:
    """The --tls-* files and the cluster token; SystemExit with a clear message when unusable."""
    tls = tls_from_args(args)
    token = os.environ.get("SPLITSERVE_CLUSTER_TOKEN") or None
    path = getattr(args, "cluster_token_file", None)
    if path:
        token = read_secret_file(path, "--cluster-token-file")
    return LinkSecurity(tls, token)


def read_secret_file(path: str, flag: str) -> str:
    """A secret (token, API key) from a file such as a mounted Secret; SystemExit naming the
    flag when it cannot be read or is empty."""
    try:
        with open(path) as f:
            secret = f.read().strip()
    except OSError as exc:
        raise SystemExit(f"{flag} {path!r}: {exc.strerror} (is the secret mounted there?)") from None
    if not secret:
        raise SystemExit(f"{flag} {path!r} is empty")
    return secret
