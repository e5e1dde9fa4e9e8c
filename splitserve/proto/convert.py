"""Between worker.proto messages and engine types (router, decode and prefill share these)."""

from __future__ import annotations

from splitserve.core.logprobs import TokenLogprobs
from splitserve.core.sampling_params import SamplingParams
from splitserve.core.structured import StructuredSpec
from splitserve.proto.build import ensure_built

ensure_built()
from splitserve.proto import worker_pb2 as pb  # noqa: E402


def sampling_to_proto(p: SamplingParams) -> pb.Sampling:
    return pb.Sampling(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        has_seed=p.seed is not None, seed=p.seed or 0, max_tokens=p.max_tokens or 0, stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        logprobs=-1 if p.logprobs is None else p.logprobs, skip_special_tokens=p.skip_special_tokens,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias, min_tokens=p.min_tokens,
        structured=None if p.structured is None else pb.Structured(
            kind=p.structured.kind, spec=p.structured.spec, param=p.structured.param),
        lora_name=p.lora_name or "")


def sampling_from_proto(s: pb.Sampling) -> SamplingParams:
    """Raises InvalidSamplingParams (naming the field) for out-of-range values."""
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        seed=s.seed if s.has_seed else None, max_tokens=s.max_tokens or None, stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        logprobs=None if s.logprobs < 0 else s.logprobs, skip_special_tokens=s.skip_special_tokens,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0, logit_bias=dict(s.logit_bias), min_tokens=s.min_tokens,
        structured=StructuredSpec(s.structured.kind, s.structured.spec, s.structured.param)
        if s.HasField("structured") else None, lora_name=s.lora_name or None)


def logprob_to_proto(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_proto(m: pb.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top])
