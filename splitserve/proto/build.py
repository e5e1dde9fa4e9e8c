"""Generate the *_pb2.py / *_pb2_grpc.py modules next to each .proto file.

Protos are compiled with the repository root as include path so that generated
modules import each other as `splitserve.proto.x_pb2` (not as top-level modules).
"""

from __future__ import annotations

import sys
from pathlib import Path


def build(force: bool = False) -> list[Path]:
    from grpc_tools import protoc

    proto_dir = Path(__file__).resolve().parent
    root = proto_dir.parent.parent
    built = []
    for proto in sorted(proto_dir.glob("*.proto")):
        out = proto.with_name(proto.stem + "_pb2.py")
        if not force and out.exists() and out.stat().st_mtime >= proto.stat().st_mtime:
            continue
        rel = proto.relative_to(root)
        args = ["grpc_tools.protoc", f"-I{root}", f"--python_out={root}", f"--grpc_python_out={root}", str(rel)]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {rel}")
        built.append(proto)
    return built


def ensure_built() -> None:
    """Called on import by modules that need generated code (fresh editable checkouts)."""
    build(force=False)


if __name__ == "__main__":
    done = build(force="--force" in sys.argv)
    print(f"generated modules for {len(done)} proto file(s)")
