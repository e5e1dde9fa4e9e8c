"""Optional mutual TLS on every internal gRPC link, issued by cert-manager
(`spec.tls.certManager.issuerRef`). Pure pieces only; render.py adds the Certificate,
render_common.py the volume, mount and flags.

One Certificate per InferenceDeployment, `NAME-tls`, for client and server use: every
pod mounts its Secret and passes --tls-cert/--tls-key/--tls-ca. Peers are dialled by
pod IP, which no certificate can name ahead of time, so the certificate names one DNS
name (`server_name`) and every component verifies that name instead of the address
(--tls-server-name): a peer must hold a certificate for this deployment from this CA.
The issuer must put the CA into the Secret's `ca.crt` (cert-manager's CA and Vault
issuers do; ACME issuers do not, and then the pods do not start: their volume names it).
cert-manager renews the Secret in place and the kubelet updates the mounted files;
new connections read them (security/tls.py), so renewal needs no restart.
"""

from __future__ import annotations

from dataclasses import dataclass

TLS_DIR = "/etc/splitserve/tls"
TLS_VOLUME = "cluster-tls"
ISSUER_KINDS = ("Issuer", "ClusterIssuer")


@dataclass(frozen=True)
class IssuerRef:
    name: str
    kind: str = "Issuer"
    group: str = "cert-manager.io"


def parse_tls(tls: dict, problems: list[str]) -> IssuerRef | None:
    """spec.tls -> the issuer, or None without certManager; problems appended."""
    cm = tls.get("certManager")
    if cm is None:
        return None
    ref = cm.get("issuerRef") if isinstance(cm, dict) else None
    if not isinstance(ref, dict) or not isinstance(ref.get("name"), str) or not ref["name"]:
        problems.append("spec.tls.certManager.issuerRef.name is required (the cert-manager Issuer or ClusterIssuer)")
        return None
    issuer = IssuerRef(ref["name"], str(ref.get("kind", "Issuer")), str(ref.get("group", "cert-manager.io")))
    if issuer.kind not in ISSUER_KINDS:
        problems.append(f"spec.tls.certManager.issuerRef.kind must be Issuer or ClusterIssuer, got {issuer.kind!r}")
    return issuer


def secret_name(name: str) -> str:
    return f"{name}-tls"


def server_name(name: str, namespace: str) -> str:
    """The one name every certificate of the deployment carries and every peer verifies."""
    return f"{name}.{namespace}.splitserve.internal"


def certificate(name: str, namespace: str, issuer: IssuerRef, metadata: dict) -> dict:
    host = server_name(name, namespace)
    return {
        "apiVersion": "cert-manager.io/v1", "kind": "Certificate", "metadata": metadata,
        "spec": {"secretName": secret_name(name), "commonName": host, "dnsNames": [host],
                 "usages": ["server auth", "client auth", "digital signature"],
                 "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
                 "issuerRef": {"name": issuer.name, "kind": issuer.kind, "group": issuer.group}},
    }


def tls_volume(name: str) -> dict:
    return {"name": TLS_VOLUME, "secret": {"secretName": secret_name(name), "defaultMode": 0o440,
                                           "items": [{"key": k, "path": k} for k in ("tls.crt", "tls.key", "ca.crt")]}}


def tls_mount() -> dict:
    return {"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True}


def tls_args(name: str, namespace: str) -> list[str]:
    return ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key", "--tls-ca", f"{TLS_DIR}/ca.crt",
            "--tls-server-name", server_name(name, namespace)]
