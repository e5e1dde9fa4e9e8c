"""What the benchmark sends (a turn of a session) and what it measured for it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Turn:
    """One request to send. `prompt` is a token-id list (completions endpoint,
    `--prompt-format ids`) or text (a user message, or a completions prompt)."""

    request_id: str
    prompt: list[int] | str
    prompt_len: int  # tokens: ids, or text fitted with the served model's tokenizer (later chat turns: + history)
    max_tokens: int
    prefix_group: int | None = None  # prefix-repetition: which shared prefix it starts with


@dataclass
class Session:
    """A unit of arrival. Single-shot workloads have one turn per session; a
    multi-turn chat sends turn k+1 after turn k, carrying the previous answers."""

    session_id: str
    turns: list[Turn]


@dataclass
class RequestResult:
    """Client-side measurements of one request; times in seconds (perf_counter)."""

    request_id: str
    success: bool = False
    start: float = 0.0  # when the request was sent
    token_times: list[float] = field(default_factory=list)  # arrivals of token-carrying chunks
    end: float | None = None  # when [DONE] arrived
    prompt_tokens: int = 0
    prompt_tokens_source: str = "estimate"  # "usage" when the server reported it
    output_tokens: int = 0
    output_tokens_source: str = "chunks"  # "usage" when the server reported it
    generated_text: str = ""
    status: int | None = None  # HTTP status; None when no response came back
    error: str = ""
    send_offset: float = 0.0  # start - benchmark start: for per-request dumps

    @property
    def chunk_count(self) -> int:
        return len(self.token_times)
