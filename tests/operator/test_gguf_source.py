"""A GGUF model source in an InferenceDeployment, accepted as it ships (issue 31): with
source.type uri and a model.path ending in .gguf every pod's init container downloads that
one file of the repository (not its other quantizations, not the --no-weights subset: the
router reads its tokenizer from the GGUF) and the workers get --model the file; a PVC path
to a .gguf is passed through as it is. The download runs for real against the fake Hub of
test_fetch_model.py."""

from splitserve.operator.render import Replicas, render_all
from splitserve.operator.spec import parse_spec
from tests.operator import test_fetch_model as hub_fixture
from tests.operator.test_fetch_model import COMMIT, downloaded, hub, run  # noqa: F401 - hub is a fixture

GGUF_FILES = {"README.md": b"# gguf", "model-Q4_K_M.gguf": b"GGUF" + b"4" * 4096,
              "model-Q8_0.gguf": b"GGUF" + b"8" * 8192}


def manifests(minimal_spec: dict, source: dict, path: str) -> dict:
    spec = {**minimal_spec, "model": {"servedName": "m", "path": path, "source": source}}
    return {(m["kind"], m["metadata"]["name"]): m
            for m in render_all(parse_spec("q", "ns", spec, "img:1"), Replicas(1, 1), "2.60.0")}


def pod_spec(rendered: dict, kind: str, name: str) -> dict:
    return rendered[(kind, name)]["spec"]["template"]["spec"]


def model_arg(container: dict) -> str:
    args = container["args"]
    return args[args.index("--model") + 1]


def test_uri_source_downloads_only_the_named_gguf_for_every_pod(hub, tmp_path, minimal_spec, monkeypatch):  # noqa: F811
    monkeypatch.setattr(hub_fixture, "FILES", GGUF_FILES)
    rendered = manifests(minimal_spec, {"type": "uri", "uri": f"hf://org/llama@{COMMIT}"}, "llama/model-Q4_K_M.gguf")
    for kind, name in (("Deployment", "q-decode"), ("Deployment", "q-router")):
        pod = pod_spec(rendered, kind, name)
        (init,) = pod["initContainers"]
        assert init["args"] == ["fetch-model", f"hf://org/llama@{COMMIT}", "/models/llama", "--file",
                                "model-Q4_K_M.gguf"]
        assert model_arg(pod["containers"][0]) == "/models/llama/model-Q4_K_M.gguf"
    dest = tmp_path / "models/llama"
    proc = run([*init["args"][:2], str(dest), *init["args"][3:]], hub, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert downloaded(dest) == {"model-Q4_K_M.gguf"}
    assert (dest / "model-Q4_K_M.gguf").read_bytes() == GGUF_FILES["model-Q4_K_M.gguf"]


def test_pvc_source_passes_a_gguf_path_through(minimal_spec):
    rendered = manifests(minimal_spec, {"type": "pvc", "claimName": "models"}, "gguf/SmolLM2-135M-Instruct.Q4_1.gguf")
    for kind, name in (("Deployment", "q-decode"), ("Deployment", "q-router")):
        pod = pod_spec(rendered, kind, name)
        assert "initContainers" not in pod
        assert model_arg(pod["containers"][0]) == "/models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
