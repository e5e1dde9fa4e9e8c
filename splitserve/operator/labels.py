"""Extra labels for the ServiceMonitor and PodMonitors the operator creates (the
operator's --monitor-label flags and spec.monitoring.labels): Kubernetes' label
syntax, and none of the labels the operator sets on every child itself."""

from __future__ import annotations

from .spec_pod import LABEL_KEY, LABEL_VALUE

RESERVED_LABEL_PREFIXES = ("app.kubernetes.io/", "splitserve.io/")


def label_problems(labels: dict, where: str) -> list[str]:
    """One line per bad key or value, naming it."""
    problems = []
    for key, value in labels.items():
        if not isinstance(key, str) or not LABEL_KEY.match(key):
            problems.append(f"{where} key {key!r} is not a label key ([DNS-subdomain prefix/]name, the name at "
                            "most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit)")
        elif key.startswith(RESERVED_LABEL_PREFIXES):
            problems.append(f"{where} must not set {key!r}: app.kubernetes.io/ and splitserve.io/ labels are "
                            "the operator's own")
        if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.match(value):
            problems.append(f"{where} value {value!r} of {key!r} is not a label value (at most 63 letters, "
                            "digits, '-', '_' or '.', beginning and ending with a letter or digit)")
    return problems
