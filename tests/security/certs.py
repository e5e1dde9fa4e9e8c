"""Test certificates made with `cryptography`: a cluster CA and a leaf certificate for
127.0.0.1/localhost usable as server and client (like one mounted secret per cluster),
plus an impostor CA with its own leaf that the cluster must refuse."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from splitserve.security.tls import TLSConfig


@dataclass
class CertFiles:
    cert: Path
    key: Path
    ca: Path

    def tls(self) -> TLSConfig:
        return TLSConfig(str(self.cert), str(self.key), str(self.ca))

    def args(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, cert: x509.Certificate | None = None, key=None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return path


def make_pki(directory: Path, name: str, dns_names: list[str] | None = None) -> CertFiles:
    """A CA `name`-ca and a leaf signed by it, written under `directory`; the leaf names
    localhost and 127.0.0.1, or only `dns_names` when given."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name(f"{name}-ca")).issuer_name(_name(f"{name}-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(_name(f"{name}-worker")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName(n) for n in dns_names] if dns_names is not None
                else [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    return CertFiles(_write(directory / f"{name}.crt", leaf), _write(directory / f"{name}.key", key=key),
                     _write(directory / f"{name}-ca.crt", ca))
