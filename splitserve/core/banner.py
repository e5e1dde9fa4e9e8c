"""The line a server prints once it accepts requests, and how programs find it in mixed output.

`splitserve serve` and `splitserve router` print `splitserve[ router]: serving '<name>' on
http://<host>:<port>/v1 (...)` when their API is up; tests, benchmarks and the profiler wait for
it. Ray forwards its workers' log lines to the driver's stdout from another thread and writes a
line and its newline separately, so the banner can land in the middle of a forwarded line (CI saw
`... (backend grpc)splitserve: serving 'x' on http://...`). Readers therefore search for the banner
anywhere in a line, never at its start.
"""

from __future__ import annotations

import re

_BANNER = re.compile(r"splitserve(?: router)?: serving .*? on (http://[^\s/]+)/v1\b")


def serving_banner(program: str, served: str, host: str, port: int, details: str) -> str:
    """The banner `program` ("splitserve" or "splitserve router") prints when it serves."""
    return f"{program}: serving {served!r} on http://{host}:{port}/v1 ({details})"


def serving_url(line: str) -> str | None:
    """The base URL (`http://host:port`) if `line` holds a serving banner, wherever in the line."""
    match = _BANNER.search(line)
    return match.group(1) if match else None
