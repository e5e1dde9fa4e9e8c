"""One logging set-up for every splitserve process: plain lines (no colour codes, so log
files and collectors read them as written), timestamp, level, logger, message."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str | int = logging.INFO) -> None:
    if isinstance(level, str):
        level = level.upper()
    logging.basicConfig(level=level, format=FORMAT)
