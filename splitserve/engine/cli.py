"""`splitserve generate`: run the engine offline on one or more prompts."""

from __future__ import annotations

import json
import sys

from splitserve.core.cli_types import OneLineParser
from splitserve.core.model_config import CheckpointError
from splitserve.core.sampling_params import InvalidSamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="splitserve generate", description=__doc__)
    ap.add_argument("prompts", nargs="+", help="prompt text (one generation per prompt)")
    ap.add_argument("--model", help="Hugging Face checkpoint directory (default: random-weight demo model)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--stop", action="append", default=[])
    ap.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    args = ap.parse_args(argv)

    from splitserve.core.model_dir import DEMO_LABEL
    from splitserve.engine import LLM, SamplingParams
    from splitserve.engine.demo import ensure_demo_checkpoint

    model = args.model
    if model is None:
        model = str(ensure_demo_checkpoint())
        print(f"splitserve: no --model given, using the {DEMO_LABEL}: {model}", file=sys.stderr)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop)
        llm = LLM(model, dtype=args.dtype, device=args.device)
    except (CheckpointError, InvalidSamplingParams, ValueError) as exc:
        print(f"splitserve generate: {exc}", file=sys.stderr)
        return 2
    prompts = args.prompts
    if args.chat:
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    for prompt, out in zip(args.prompts, llm.generate(prompts, params), strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason}))
        else:
            print(out.text)
    return 0
