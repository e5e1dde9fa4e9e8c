#!/usr/bin/env bash
# One-shot set-up for a fresh clone: system packages, virtualenv, pinned torch,
# the package with its test extras, and the generated gRPC modules.
# Idempotent: `make` only reruns it when pyproject.toml or a .proto changes.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

# System packages the tests start for real: redis-server (cluster bus),
# libibverbs1 (the Mooncake Transfer Engine links against it even in tcp mode), g++ (the
# native CPU kernels are compiled on first use), libtcmalloc-minimal4 (preloaded into CPU
# engine processes, engine/allocator.py), and podman, buildah and mmdebstrap
# (tests/image builds the image and serves from it).
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v g++ >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1 || need+=(g++)
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || need+=(libibverbs1)
ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal.so.4' || need+=(libtcmalloc-minimal4)
for tool in podman buildah mmdebstrap; do
  command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
done
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing system packages: ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi

# promtool, for the alert unit tests (tests/chart/test_alerts.py), from Debian's
# prometheus package: unpacked into the venv, not installed, since installing it adds
# a system user and enables and starts a Prometheus server (or fails to, without systemd).
if ! command -v promtool >/dev/null 2>&1 && [ ! -x "$VENV/bin/promtool" ]; then
  echo "setup: unpacking promtool from Debian's prometheus package"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  tmp=$(mktemp -d)
  chmod 755 "$tmp"  # apt's _apt user downloads into it
  (cd "$tmp" && { apt-get download -qq prometheus 2>/dev/null \
                  || { $SUDO apt-get update -qq && apt-get download -qq prometheus; }; })
  dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/pkg"
  install -m 0755 "$tmp/pkg/usr/bin/promtool" "$VENV/bin/promtool"
  rm -rf "$tmp"
fi

# torch first and pinned: on a machine without a GPU this takes the CPU build,
# and every later requirement (>=2.4) is already satisfied by it, so nothing
# pulls a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" 2>/dev/null; then
  echo "setup: installing torch==$TORCH_VERSION"
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
fi

echo "setup: installing splitserve with test extras"
"$VENV/bin/pip" install -q -e ".[test]"

echo "setup: generating gRPC modules"
"$VENV/bin/python" -m splitserve.proto.build
echo "setup: done"
