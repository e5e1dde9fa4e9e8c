"""`--prefill-timeout`: how long a decode worker gives a remote prefill, KV transfer
included, before it prefills locally. Light on imports: `serve`'s parser reads it."""

from __future__ import annotations

import argparse

DEFAULT_PREFILL_TIMEOUT_S = 30.0
MAX_PREFILL_TIMEOUT_S = 600.0  # what a prefill worker accepts (prefill_worker/worker.py MAX_PUSH_TIMEOUT_S)


def prefill_timeout_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= MAX_PREFILL_TIMEOUT_S:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be in (0, {MAX_PREFILL_TIMEOUT_S:g}] seconds, got {text}")
    return value


def add_prefill_timeout_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prefill-timeout", type=prefill_timeout_seconds, default=DEFAULT_PREFILL_TIMEOUT_S,
                    help="seconds a decode worker gives a remote prefill, KV transfer included, before it prefills "
                         "locally; a prefill worker refuses at once a prompt it cannot finish in time at its "
                         "measured rate (raise this for long prompts on slow hardware; default: %(default)s)")
