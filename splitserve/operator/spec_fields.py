"""Reading one field of a spec dict that the API server may not have defaulted or
checked: a wrong type or range becomes a problem naming the field, never an exception."""

from __future__ import annotations


def int_field(d: dict, key: str, default: int, where: str, problems: list[str], minimum: int = 0) -> int:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(f"{where}.{key} must be an integer, got {value!r}")
        return default
    if value < minimum:
        problems.append(f"{where}.{key} must be >= {minimum}, got {value}")
    return value


def bool_field(d: dict, key: str, default: bool, where: str, problems: list[str]) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        problems.append(f"{where}.{key} must be true or false, got {value!r}")
        return default
    return value


def float_field(d: dict, key: str, default: float, where: str, problems: list[str]) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        problems.append(f"{where}.{key} must be a number, got {value!r}")
        return default
    return float(value)


def object_field(spec: dict, key: str, problems: list[str]) -> dict:
    value = spec.get(key, {})
    if not isinstance(value, dict):
        problems.append(f"spec.{key} must be an object, got {type(value).__name__}")
        return {}
    return value
