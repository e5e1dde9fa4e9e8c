"""argparse value types shared by the CLIs (router, workers, serve): a bad value is refused
by argparse itself, with the flag's name, before anything starts; and their parser, whose
errors are one line (OneLineParser)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1 (thread counts, CPU counts, token intervals)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, `PROG: argument -tp/--tensor-parallel-size:
    must be >= 1, got 0`, exit 2: argparse's own prints the whole usage block first (52 lines for
    `serve`), burying the one line that says what is wrong. --help still prints it all."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {' '.join(message.split())}\n")
