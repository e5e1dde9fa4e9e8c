"""The per-deployment cluster token: one Secret per InferenceDeployment holding the token
every internal gRPC link (bus bridge, Generate, Prefill, KV receivers) must present, as
`splitserve serve` generates one per run on a single machine.

- Created by the operator with a random value (never rendered: the render is pure, and
  re-applying a rendered token would change it), owned by the InferenceDeployment, so
  Kubernetes deletes it with the deployment.
- Mounted read-only into every pod (router, decode, the Ray head and workers of the
  prefill pool) at render_common.TOKEN_FILE, and passed as `--cluster-token-file`.
- Rotated by deleting it: the next reconcile creates a new one, and the pod templates
  carry a hash of the token (render_common.TOKEN_HASH_ANNOTATION), so the Deployments roll. Processes
  read the token once at start: a pod with the old token is refused by peers with the
  new one, so a rotation is a full restart of the deployment (plan it like an upgrade).
"""

from __future__ import annotations

import base64
import hashlib
import secrets

from .kube import ApiError, KubeClient
from .render_common import TOKEN_KEY, adopt, labels
from .spec import InferenceSpec


class TokenUnavailable(RuntimeError):
    pass


def token_secret(spec: InferenceSpec, token: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": spec.cluster_token_secret, "namespace": spec.namespace,
                         "labels": labels(spec, "cluster-token")},
            "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()}}


def token_hash(secret: dict) -> str:
    """What the pod templates carry: changes with the token, reveals nothing of it."""
    data = (secret.get("data") or {}).get(TOKEN_KEY, "")
    return hashlib.sha256(data.encode()).hexdigest()[:16]


async def ensure_token_secret(client: KubeClient, owner: dict, spec: InferenceSpec) -> str:
    """The token Secret's hash, creating the Secret first when it does not exist (first
    reconcile, or deleted to rotate). A create (POST), never an apply: a Secret created
    meanwhile by another reconcile is kept (409), not overwritten."""
    name = spec.cluster_token_secret
    try:
        secret = await client.get("v1", "Secret", spec.namespace, name)
        if secret is None:
            body = adopt(token_secret(spec, secrets.token_urlsafe(32)), owner)
            try:
                secret = await client.create(body)
            except ApiError as exc:
                if exc.status != 409:
                    raise
                secret = await client.get("v1", "Secret", spec.namespace, name)
    except ApiError as exc:
        hint = "; the chart grants get, create and delete on Secrets (rbac.yaml)" if exc.status == 403 else ""
        raise TokenUnavailable(f"cannot read or create the cluster token Secret {spec.namespace}/{name}: "
                               f"HTTP {exc.status}: {exc.message}{hint}") from exc
    if secret is None or not (secret.get("data") or {}).get(TOKEN_KEY):
        raise TokenUnavailable(f"the cluster token Secret {spec.namespace}/{name} has no key {TOKEN_KEY!r}; "
                               "delete it and the operator creates a new one")
    return token_hash(secret)
