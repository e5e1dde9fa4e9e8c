"""A request body as JSON: parsed safely, then read field by field.

A client may send anything: JSON nested thousands deep, unpaired UTF-16 surrogates
(`\\ud800`, which no tokenizer or encoder can take), `NaN`, integers with hundreds of
digits. Each is an `APIError` 4xx naming the field, never a 500 further down."""

from __future__ import annotations

import math

from splitserve.core import bounded_json
from splitserve.router import errors


def load(raw: bytes | str | dict) -> dict:
    if isinstance(raw, dict):
        body = raw
    else:
        try:
            body = bounded_json.loads(raw, parse_constant=_no_constants)
        except bounded_json.NestedTooDeeply as exc:
            raise errors.invalid_request(
                f"the JSON body is {exc}; no OpenAI request needs more than a few levels", None,
                "invalid_json") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise errors.invalid_request(
                f"could not parse the JSON body of the request ({exc}); send a JSON object "
                "with Content-Type: application/json", None, "invalid_json") from None
        except RecursionError:  # not reached (bounded_json measured the depth); kept as a backstop
            raise errors.invalid_request(
                "the JSON body is nested too deeply to parse; no OpenAI request needs more than a "
                "few levels", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise errors.invalid_request("the request body must be a JSON object", None,
                                     "invalid_json")
    if isinstance(raw, dict) or b"\\u" in _as_bytes(raw):  # only \uXXXX escapes can carry a surrogate
        _reject_lone_surrogates(body)
    return body


def _as_bytes(raw: bytes | str) -> bytes:
    return raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")


def _reject_lone_surrogates(body: dict) -> None:
    """JSON may spell an unpaired UTF-16 surrogate (\\ud800), which is not text: no
    tokenizer, stop-string matcher or encoder can take it. Walked without recursion."""
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise errors.invalid_request(
                    f"'{where or 'body'}' contains an unpaired UTF-16 surrogate (\\ud800-\\udfff); send valid "
                    "Unicode text", where or None, "invalid_value") from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((f"{where}.{k}" if where else str(k), k))
                stack.append((f"{where}.{k}" if where else str(k), v))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def opt_int(body: dict, name: str, default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.wrong_type(name, "an integer", value)
    return value


def opt_number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise errors.wrong_type(name, "a number", value)
    try:
        number = float(value)
    except OverflowError:  # an integer with hundreds of digits
        number = math.inf
    if not math.isfinite(number):
        raise errors.invalid_request(f"'{name}' must be a finite number", name, "invalid_value")
    return number


def opt_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise errors.wrong_type(name, "a boolean", value)
    return value


def opt_str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise errors.wrong_type(name, "a string", value)
    return value
