"""A thin async Kubernetes REST client for the children the operator manages.

It uses the credentials kopf logged in with (kopf.ConnectionInfo), so kopf's watch
and our writes always talk to the same API server as the same identity. Only the
calls the operator needs exist: get, create, server-side apply, merge-patch, delete.
"""

from __future__ import annotations

import json

import aiohttp

FIELD_MANAGER = "splitserve-operator"

# kind -> plural, for every kind the operator reads or writes (Secrets: get and create,
# for the cluster token; cluster_token.py).
PLURALS = {
    "Deployment": "deployments", "Service": "services", "RayCluster": "rayclusters",
    "PodDisruptionBudget": "poddisruptionbudgets", "NetworkPolicy": "networkpolicies",
    "ServiceMonitor": "servicemonitors", "PodMonitor": "podmonitors",
    "InferenceDeployment": "inferencedeployments", "Secret": "secrets", "Certificate": "certificates",
}


class ApiError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, message: str):
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status, self.method, self.path, self.message = status, method, path, message


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None,
                  subresource: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{PLURALS[kind]}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class KubeClient:
    def __init__(self, info):
        """`info`: a kopf.ConnectionInfo (server, CA, token or client certificate)."""
        self.server = info.server.rstrip("/")
        self._headers = {"Accept": "application/json", **info.as_http_headers()}
        # kopf builds the TLS context (CA, client certificate, insecure flag) itself.
        self._ssl = info.as_ssl_context() if info.server.startswith("https") else False
        self._session: aiohttp.ClientSession | None = None

    async def _request(self, method: str, path: str, body: dict | None = None,
                       content_type: str = "application/json", params: dict | None = None) -> dict | None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        headers = {**self._headers, "Content-Type": content_type}
        data = json.dumps(body) if body is not None else None
        async with self._session.request(method, self.server + path, data=data, headers=headers,
                                         params=params, ssl=self._ssl) as resp:
            text = await resp.text()
            if resp.status == 404 and method == "GET":
                return None
            if resp.status >= 400:
                try:
                    message = json.loads(text).get("message", text)
                except ValueError:
                    message = text
                raise ApiError(resp.status, method, path, message)
            return json.loads(text) if text else {}

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        return await self._request("GET", resource_path(api_version, kind, namespace, name))

    async def apply(self, manifest: dict) -> dict:
        """Server-side apply: creates or updates, and removes fields this manager set
        before but no longer renders; force=true takes fields back from hand edits."""
        m = manifest["metadata"]
        path = resource_path(manifest["apiVersion"], manifest["kind"], m["namespace"], m["name"])
        return await self._request("PATCH", path, manifest, "application/apply-patch+yaml",
                                   {"fieldManager": FIELD_MANAGER, "force": "true"})

    async def create(self, manifest: dict) -> dict:
        """POST: 409 (ApiError) when it exists, so nothing existing is ever overwritten."""
        m = manifest["metadata"]
        return await self._request("POST", resource_path(manifest["apiVersion"], manifest["kind"], m["namespace"]),
                                   manifest)

    async def patch_status(self, api_version: str, kind: str, namespace: str, name: str, status: dict) -> dict:
        path = resource_path(api_version, kind, namespace, name, "status")
        return await self._request("PATCH", path, {"status": status}, "application/merge-patch+json")

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        path = resource_path(api_version, kind, namespace, name)
        try:
            await self._request("DELETE", path, {"propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
