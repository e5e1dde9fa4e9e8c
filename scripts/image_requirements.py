"""The runtime requirements the image installs, out of pyproject.toml (stdlib only: it runs
in the Dockerfile's `requirements` stage, before any package is installed).

    python3 scripts/image_requirements.py pyproject.toml cpu|gpu > requirements.txt

torch is left out (the Dockerfile installs the flavour's build first, pinned). The CPU
flavour also leaves Triton out (1 GB): its kernels need a GPU, and on CPU tensors the engine
runs the torch reference kernels (splitserve/kernels/ops.py). The mooncake extra is in:
the operator may render `--kv-backend mooncake`.
"""

from __future__ import annotations

import re
import sys
import tomllib

EXTRAS = ("mooncake",)


def requirement_name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def image_requirements(pyproject: dict, flavour: str) -> list[str]:
    if flavour not in ("cpu", "gpu"):
        raise ValueError(f"flavour must be cpu or gpu, got {flavour!r}")
    project = pyproject["project"]
    skip = {"torch"} | ({"triton"} if flavour == "cpu" else set())
    wanted = list(project["dependencies"])
    for extra in EXTRAS:
        wanted += project["optional-dependencies"][extra]
    return [r for r in wanted if requirement_name(r) not in skip]


def main(argv: list[str]) -> int:
    path, flavour = argv
    with open(path, "rb") as f:
        print("\n".join(image_requirements(tomllib.load(f), flavour)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
