"""argparse value types shared by the CLIs (router, workers, serve): a bad value is refused
by argparse itself, with the flag's name, before anything starts."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1 (thread counts, CPU counts, token intervals)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
