"""API keys: every /v1 endpoint answers 401 in OpenAI's format for a missing or wrong
key, whatever its length or shape; the right key passes; probes stay open."""

from __future__ import annotations

import pytest
import requests

from tests.security.conftest import API_KEY, SERVED

ENDPOINTS = [("POST", "/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": 1}),
             ("POST", "/v1/chat/completions", {"model": SERVED, "max_tokens": 1,
                                               "messages": [{"role": "user", "content": "hi"}]}),
             ("GET", "/v1/models", None),
             ("POST", "/v1/embeddings", {"model": SERVED, "input": "hi"})]  # unknown: 401 before 404
WRONG = {"missing": {}, "empty": {"Authorization": ""}, "no bearer": {"Authorization": API_KEY},
         "prefix of the key": {"Authorization": f"Bearer {API_KEY[:-1]}"},
         "key plus a char": {"Authorization": f"Bearer {API_KEY}x"},
         "other key same length": {"Authorization": "Bearer " + "x" * len(API_KEY)},
         "basic auth": {"Authorization": "Basic dXNlcjpwYXNz"}, "non-ascii": {"Authorization": "Bearer ключ".encode()},
         "invalid utf-8": {"Authorization": b"Bearer \xff\xfe"}}


@pytest.mark.parametrize("method, path, body", ENDPOINTS, ids=[e[1] for e in ENDPOINTS])
def test_missing_or_wrong_key_is_401(stack, method, path, body):
    for what, headers in WRONG.items():
        r = requests.request(method, stack.base_url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (what, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key", what
    r = requests.request(method, stack.base_url + path, json=body, headers=stack.auth, timeout=30)
    assert r.status_code == (404 if path == "/v1/embeddings" else 200), r.text


def test_probes_and_the_api_document_need_no_key(stack):
    for path in ("/health", "/metrics", "/openapi.json"):
        assert requests.get(stack.base_url + path, timeout=30).status_code == 200, path


def test_keys_are_compared_in_constant_time():
    """The comparison is hmac.compare_digest over bytes (timing does not leak how much of a
    guess matched); checked in the source, since timing assertions do not belong in tests."""
    import inspect

    from splitserve.router import server

    compare = inspect.getsource(server._bearer_is)
    assert "hmac.compare_digest(given_bytes, key.encode())" in compare
    for check in (compare, inspect.getsource(server.RouterServer._auth),
                  inspect.getsource(server.RouterServer._admin_auth)):  # the API key and the admin key
        assert "given ==" not in check and "== key" not in check and "== given" not in check
        assert "== admin" not in check and "admin ==" not in check
    assert "_bearer_is(request, key)" in inspect.getsource(server.RouterServer._auth)
    assert "_bearer_is(request, admin)" in inspect.getsource(server.RouterServer._admin_auth)
