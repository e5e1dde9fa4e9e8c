"""What a LoRA adapter may be called: the name requests give as `model`, so it goes into
/v1/models, log lines, metric labels and error messages. Torch-free: the router, the CLI
checks and the engine all use it."""

from __future__ import annotations

import re

MAX_NAME_CHARS = 256
# letters, digits and . _ : / @ + - (HF-style "org/name@rev" fits); no whitespace or control
# characters, so a name can never split a log line or a header
NAME_RULE = re.compile(r"[A-Za-z0-9._:/@+-]+")
RULE_TEXT = f"1 to {MAX_NAME_CHARS} characters from A-Z a-z 0-9 . _ : / @ + -"


def lora_name_problem(name: object) -> str | None:
    """Why `name` cannot name an adapter (one line, the name itself never echoed in full), or None."""
    if not isinstance(name, str) or not name:
        return f"a LoRA adapter name must be {RULE_TEXT}"
    if len(name) > MAX_NAME_CHARS:
        return f"a LoRA adapter name must be {RULE_TEXT}; got {len(name)} characters"
    if not NAME_RULE.fullmatch(name):
        bad = next(c for c in name if not NAME_RULE.fullmatch(c))
        return f"a LoRA adapter name must be {RULE_TEXT}; got {bad!r} in {name!r}"
    return None
