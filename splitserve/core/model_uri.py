"""Model URIs (an InferenceDeployment's `spec.model.source.uri`) and the download
the operator's init container runs before a pod's main container starts:

    splitserve fetch-model hf://ORG/NAME[@REVISION] DEST [--no-weights | --file NAME.gguf]

`huggingface_hub.snapshot_download` does the work (resumable, parallel, checks
sizes and hashes, reads HF_TOKEN and HTTPS_PROXY from the environment); a repeated
run on the same DEST only fetches what is missing. Only hf:// is supported: s3://
would be the same pattern (an init container writing into the model volume), but
nothing here implements it, and the CRD refuses it with a message saying so.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from splitserve.core.cli_types import OneLineParser

# Hugging Face repo ids are ORG/NAME; a revision is a branch, tag or commit (refs/pr/1 too).
HF_URI = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*)"
                    r"(@(?P<revision>[A-Za-z0-9][-A-Za-z0-9_./]*))?$")
URI_RULE = ("source.uri must be hf://ORG/NAME[@REVISION] when source.type is uri (s3:// is not supported: "
            "copy the model to a PVC with a Job of your own and use source.type pvc)")
# The engine loads *.safetensors, or one named .gguf (--file): other weight formats a
# repository may also carry (PyTorch .bin, the original consolidated checkpoints, GGUF
# files not asked for, ...) are never downloaded.
UNUSED_WEIGHTS = ["*.bin", "*.pt", "*.pth", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "*.ot", "*.tflite",
                  "original/*"]
WEIGHTS = ["*.safetensors"]


@dataclass(frozen=True)
class ModelUri:
    repo_id: str
    revision: str | None  # None: the repository's default branch


def parse_model_uri(uri: str) -> ModelUri:
    """ValueError (with the CRD's message) unless `uri` is hf://ORG/NAME[@REVISION]."""
    m = HF_URI.match(uri)
    if not m or len(uri) > 512:
        raise ValueError(URI_RULE)
    return ModelUri(m["repo"], m["revision"])


def fetch_model(uri: str, dest: str, weights: bool = True, file: str | None = None) -> str:
    """Download the repository snapshot into `dest` (config, tokenizer and, with
    `weights`, the safetensors), or only `file` of it (a .gguf: config, tokenizer and
    weights in one file, of the several quantizations a GGUF repository holds); returns `dest`."""
    from huggingface_hub import snapshot_download

    model = parse_model_uri(uri)
    if file:
        return snapshot_download(model.repo_id, revision=model.revision, local_dir=dest, allow_patterns=[file])
    ignore = UNUSED_WEIGHTS + ([] if weights else WEIGHTS)
    return snapshot_download(model.repo_id, revision=model.revision, local_dir=dest, ignore_patterns=ignore)


def main(argv: list[str]) -> int:
    ap = OneLineParser(prog="splitserve fetch-model",
                       description="Download a model URI into a directory (the operator's init "
                                   "container). HF_TOKEN, if set, authenticates.")
    ap.add_argument("uri", help="hf://ORG/NAME or hf://ORG/NAME@REVISION")
    ap.add_argument("dest", help="directory the snapshot is written to")
    ap.add_argument("--no-weights", action="store_true",
                    help="config and tokenizer only (the router and the Ray head never load weights)")
    ap.add_argument("--file", help="only this file of the repository (a .gguf; the operator passes it when "
                                   "spec.model.path ends in .gguf)")
    args = ap.parse_args(argv)
    try:
        parse_model_uri(args.uri)
    except ValueError:
        print(f"splitserve fetch-model: {args.uri!r} is not hf://ORG/NAME[@REVISION] (s3:// is not supported)",
              file=sys.stderr)
        return 2
    try:
        path = fetch_model(args.uri, args.dest, weights=not args.no_weights, file=args.file)
    except Exception as exc:  # noqa: BLE001 - one line the pod's events and logs can show
        print(f"splitserve fetch-model: downloading {args.uri} failed: {type(exc).__name__}: {exc} "
              "(a gated or private repository needs a token: spec.model.source.tokenSecretRef)", file=sys.stderr)
        return 1
    print(f"fetched {args.uri} into {path}", flush=True)
    return 0
