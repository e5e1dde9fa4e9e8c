"""Multi-LoRA through `splitserve serve` for real (Ray, 1 prefill + 1 decode worker, gRPC KV
transfer) and the OpenAI client: three PEFT adapters and the base model interleaved at
concurrency 8 come back token for token as transformers + PeftModel make them, both on the
disaggregated path (prompts of 40 tokens, --strict-disaggregation: prefilled on the prefill
worker under the same adapter, KV moved under the adapter's block hashes) and colocated
(short prompts prefilled on the decode worker, and a `--prefill-workers 0` serve with 2 slots
for the 3 adapters); the same prompt under adapter B after adapter A gets B's tokens on each
path; /v1/models lists the adapters with `parent`;
runtime load, use, unload and use-after-unload (404 model_not_found), behind the admin key
(401 without a key, 403 with the API key); bad adapters refused with a 400 in one line and
nothing changed."""

from __future__ import annotations

import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from splitserve.core.tokenizer import Tokenizer
from tests.helpers.lora_adapters import ADAPTERS, make_adapter, peft_greedy
from tests.helpers.processes import SplitserveProcess

SERVED = "lora-base"
KEY = "lora-test-key"
ADMIN_KEY = "lora-admin-key"  # loading and unloading adapters take this one, not the API key
NEW = 12


@pytest.fixture(scope="module")
def stack(make_ckpt, tmp_path_factory):
    base = make_ckpt("llama")
    root = tmp_path_factory.mktemp("adapters")
    adapters = {name: make_adapter(base, root / name, **spec) for name, spec in ADAPTERS.items()}
    modules = [f"{name}={path}" for name, path in adapters.items() if name != "mlp-r16"]  # the third: at runtime
    serve = SplitserveProcess("serve", [
        "--model", str(base), "--served-model-name", SERVED, "--prefill-workers", "1", "--decode-workers", "1",
        "--num-kv-blocks", "256", "--disagg-min-uncached-tokens", "24", "--strict-disaggregation", "--enable-lora", "--max-loras", "3",
        "--max-lora-rank", "16", "--lora-modules", *modules],
        env={"SPLITSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1", "SPLITSERVE_API_KEY": KEY,
             "SPLITSERVE_ADMIN_API_KEY": ADMIN_KEY})
    client = openai.OpenAI(base_url=serve.base_url + "/v1", api_key=KEY, max_retries=0)
    admin = openai.OpenAI(base_url=serve.base_url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    try:
        yield base, adapters, root, serve, client, admin
    finally:
        serve.stop()
        log = serve.log()
        assert "Traceback" not in log, log[max(0, log.find("Traceback") - 1500):][:6000]


def complete(client, model: str, prompt: list[int]):
    raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=NEW, temperature=0,
                                                      extra_body={"ignore_eos": True})
    workers = dict(p.split("=", 1) for p in raw.headers["x-splitserve-workers"].split("; "))
    workers["route"] = raw.headers["x-splitserve-route"]
    return raw.parse(), workers


def load(client, name: str, path) -> str:
    """vLLM's endpoint through the OpenAI client's own request path (errors raise its exceptions)."""
    return client.post("/load_lora_adapter", body={"lora_name": name, "lora_path": str(path)}, cast_to=str)


def unload(client, name: str) -> str:
    return client.post("/unload_lora_adapter", body={"lora_name": name}, cast_to=str)


def test_adapters_and_base_interleaved_match_peft_on_both_paths(stack):
    base, adapters, _, serve, client, admin = stack
    assert load(admin, "mlp-r16", adapters["mlp-r16"]) == "Success: LoRA adapter 'mlp-r16' added successfully."
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {SERVED, *ADAPTERS}
    assert all(models[n].model_extra["parent"] == SERVED for n in ADAPTERS)
    tok = Tokenizer(base)
    rng = random.Random(3)
    names = [*ADAPTERS, SERVED]
    jobs = [(names[i % 4], [rng.randrange(5, 1000) for _ in range(40 if i < 8 else 15)]) for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: complete(client, *job), jobs))
    for (model, prompt), (out, workers) in zip(jobs, results, strict=True):
        adapter = None if model == SERVED else adapters[model]
        assert out.choices[0].text == tok.decode(peft_greedy(base, adapter, prompt, NEW)), (model, len(prompt))
        # --strict-disaggregation: the path follows the uncached length alone (not the backlogs)
        assert workers["prefill"] == ("prefill-0" if len(prompt) == 40 else "decode-0"), (model, workers["route"])
    metrics = requests.get(serve.base_url + "/metrics", timeout=10).text  # (/metrics takes no key)
    for name in ADAPTERS:  # 4 requests each, 12 tokens each
        assert f'splitserve_lora_requests_total{{adapter="{name}"}} 4.0' in metrics, name
        assert f'splitserve_lora_generation_tokens_total{{adapter="{name}"}} 48.0' in metrics, name


@pytest.mark.parametrize("length", [40, 15], ids=["disaggregated", "colocated"])
def test_same_prompt_under_b_after_a_gets_b_tokens(stack, length):
    base, adapters, _, serve, client, _ = stack
    tok = Tokenizer(base)
    prompt = [random.Random(length).randrange(5, 1000) for _ in range(length)]
    blocks = length // 16
    first, _ = complete(client, "all-r8", prompt)
    again, routed = complete(client, "all-r8", prompt)
    # the router's index hashes the prompt with the adapter's salt, as the workers do: a hit
    assert f"cached={blocks}/{blocks}" in routed["route"], routed["route"]
    assert again.usage.prompt_tokens_details.cached_tokens > 0 or length < 17
    second, workers = complete(client, "qv-r4-rslora", prompt)
    assert f"cached=0/{blocks}" in workers["route"], workers["route"]  # nothing cached under B
    assert workers["prefill"] == ("prefill-0" if length == 40 else "decode-0"), workers  # prefilled there
    assert first.choices[0].text == tok.decode(peft_greedy(base, adapters["all-r8"], prompt, NEW))
    assert second.choices[0].text == tok.decode(peft_greedy(base, adapters["qv-r4-rslora"], prompt, NEW))
    assert second.usage.prompt_tokens_details.cached_tokens == 0


def test_runtime_load_use_unload_and_bad_adapters(stack, make_ckpt):
    base, adapters, root, serve, client, admin = stack
    tok = Tokenizer(base)
    prompt = list(range(30, 70))
    anonymous = requests.post(serve.base_url + "/v1/load_lora_adapter", timeout=10,
                              json={"lora_name": "late", "lora_path": str(adapters["qv-r4-rslora"])})
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.PermissionDeniedError) as err:  # the API key is not the admin key
        load(client, "late", adapters["qv-r4-rslora"])
    assert err.value.body["code"] == "insufficient_permissions"
    assert load(admin, "late", adapters["qv-r4-rslora"]).startswith("Success")
    out, _ = complete(client, "late", prompt)
    assert out.choices[0].text == tok.decode(peft_greedy(base, adapters["qv-r4-rslora"], prompt, NEW))
    assert unload(admin, "late") == "Success: LoRA adapter 'late' removed successfully."
    with pytest.raises(openai.NotFoundError) as err:
        complete(client, "late", prompt)
    assert err.value.body["code"] == "model_not_found"
    before = sorted(m.id for m in client.models.list().data)
    too_big = make_adapter(base, root / "r32", seed=9, r=32, alpha=32)
    other = make_adapter(make_ckpt("mistral"), root / "mistral", seed=10, r=4, alpha=8)
    hostile = {}  # malformed configs (issue 48): a 400 naming the field, no traceback in serve's log
    for label, config in (("alpha", '{"peft_type": "LORA", "r": 8, "lora_alpha": "sixteen"}'),
                          ("list", '[{"r": 8}]')):
        hostile[label] = root / f"hostile-{label}"
        shutil.copytree(adapters["all-r8"], hostile[label], dirs_exist_ok=True)
        (hostile[label] / "adapter_config.json").write_text(config)
    for name, path, why in [("big", too_big, "has rank 32, above --max-lora-rank 16"),
                            ("other", other, "does not fit this model"),
                            ("missing", root / "missing", "is not a directory"),
                            ("alpha", hostile["alpha"], "lora_alpha must be a finite number, got 'sixteen'"),
                            ("list", hostile["list"], "adapter_config.json must be a JSON object, got a list")]:
        with pytest.raises(openai.BadRequestError) as err:
            load(admin, name, path)
        message = err.value.body["message"]
        assert why in message and "\n" not in message and "RpcError" not in message, message
    assert sorted(m.id for m in client.models.list().data) == before
    with pytest.raises(openai.NotFoundError):
        unload(admin, "never-loaded")


def test_colocated_serve_interleaves_adapters_as_peft_does(stack):
    """`serve --prefill-workers 0`: every prompt prefilled on the one decode worker."""
    base, adapters, _, _, _, _ = stack
    modules = [f"{name}={path}" for name, path in adapters.items()]
    serve = SplitserveProcess("serve", [
        "--model", str(base), "--served-model-name", SERVED, "--prefill-workers", "0", "--decode-workers", "1",
        "--num-kv-blocks", "256", "--enable-lora", "--max-loras", "2", "--lora-modules", *modules])
    try:
        client = openai.OpenAI(base_url=serve.base_url + "/v1", api_key="unused", max_retries=0)
        tok = Tokenizer(base)
        rng = random.Random(11)
        names = [*ADAPTERS, SERVED]
        jobs = [(names[i % 4], [rng.randrange(5, 1000) for _ in range(rng.choice((15, 40)))]) for i in range(8)]
        with ThreadPoolExecutor(8) as pool:  # 3 adapters over 2 slots: admission waits, slots swap
            results = list(pool.map(lambda job: complete(client, *job), jobs))
        for (model, prompt), (out, workers) in zip(jobs, results, strict=True):
            adapter = None if model == SERVED else adapters[model]
            assert out.choices[0].text == tok.decode(peft_greedy(base, adapter, prompt, NEW)), (model, len(prompt))
            assert workers["prefill"] == "decode-0"
    finally:
        serve.stop()
    assert "Traceback" not in serve.log()
