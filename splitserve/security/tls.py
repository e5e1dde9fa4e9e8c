"""Mutual TLS for every gRPC link: router -> decode worker, decode -> prefill worker,
prefill -> decode KV receiver, workers -> embedded bus bridge.

One `TLSConfig` (certificate, key, CA bundle: PEM files, e.g. a mounted Kubernetes
secret) per process. Servers demand a client certificate signed by the CA; clients
present theirs and verify the server's against the same CA. With no TLSConfig every
link is plaintext (development on one machine).

Peers are dialled by IP (pod IPs change), so certificates rarely name them: set
`server_name` (--tls-server-name) to the DNS name every worker certificate carries,
and clients verify that name instead of the address they dialled.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import grpc


class TLSConfigError(ValueError):
    """Missing or unreadable certificate files: raised at start-up, never mid-request."""


@dataclass(frozen=True)
class TLSConfig:
    cert_file: str
    key_file: str
    ca_file: str
    server_name: str | None = None  # name to verify in peers' certificates (default: the address)

    def __post_init__(self) -> None:
        for flag, path in (("--tls-cert", self.cert_file), ("--tls-key", self.key_file),
                           ("--tls-ca", self.ca_file)):
            if not path or not os.path.isfile(path):
                raise TLSConfigError(f"{flag} {path!r}: no such file (mount the TLS secret, or drop all "
                                     "--tls-* flags to run without TLS)")

    def _read(self) -> tuple[bytes, bytes, bytes]:
        # Read at use time: a rotated secret is picked up by new servers and channels.
        try:
            with open(self.cert_file, "rb") as c, open(self.key_file, "rb") as k, open(self.ca_file, "rb") as a:
                return c.read(), k.read(), a.read()
        except OSError as exc:
            raise TLSConfigError(f"cannot read the TLS files: {exc}") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def add_tls_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("mutual TLS on gRPC links (all three files, or none)")
    g.add_argument("--tls-cert", default=os.environ.get("SPLITSERVE_TLS_CERT"),
                   help="PEM certificate this process presents (default: $SPLITSERVE_TLS_CERT)")
    g.add_argument("--tls-key", default=os.environ.get("SPLITSERVE_TLS_KEY"),
                   help="PEM private key of --tls-cert (default: $SPLITSERVE_TLS_KEY)")
    g.add_argument("--tls-ca", default=os.environ.get("SPLITSERVE_TLS_CA"),
                   help="PEM CA bundle peers' certificates must chain to (default: $SPLITSERVE_TLS_CA)")
    g.add_argument("--tls-server-name", default=os.environ.get("SPLITSERVE_TLS_SERVER_NAME"),
                   help="name verified in peers' certificates instead of the dialled address")


def tls_from_args(args: argparse.Namespace) -> TLSConfig | None:
    """The TLSConfig of the --tls-* flags; None when none is given; SystemExit when only some are."""
    files = (args.tls_cert, args.tls_key, args.tls_ca)
    if not any(files):
        return None
    if not all(files):
        raise SystemExit("mutual TLS needs all of --tls-cert, --tls-key and --tls-ca (got "
                         + ", ".join(f"{n}={v!r}" for n, v in zip(("cert", "key", "ca"), files, strict=True)) + ")")
    try:
        return TLSConfig(*files, server_name=args.tls_server_name or None)
    except TLSConfigError as exc:
        raise SystemExit(str(exc)) from None
