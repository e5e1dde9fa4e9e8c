#!/usr/bin/env bash
# Build the splitserve image from the repository's Dockerfile with podman: no Docker
# daemon and no registry needed. CI (tests/image) and the release workflow both call this.
#
#   scripts/build_image.sh [--flavour cpu|gpu] [--tag NAME]
#
# cpu (default tag localhost/splitserve:APPVERSION-cpu): the base is Debian bookworm made
#      here with `mmdebstrap --variant=minbase` and `podman import`; the CPU build of torch
#      is fetched by this machine's pip, so its configuration and PIP_EXTRA_INDEX_URL apply
#      (e.g. https://download.pytorch.org/whl/cpu).
# gpu (default tag localhost/splitserve:APPVERSION): the base is pulled (GPU_BASE_IMAGE);
#      torch is the CUDA build from PyPI.
# APPVERSION is the chart's appVersion; the build fails if the package reports another.
#
# Caches, kept between runs on the same machine (a fresh machine fills them):
#   $SPLITSERVE_IMAGE_CACHE (default ~/.cache/splitserve-image): the base rootfs tarball
#     (made again when older than a week, for Debian's updates) and the torch wheel;
#   podman's layer cache: the dependency layers are rebuilt only when the base, the torch
#     version or the runtime dependencies in pyproject.toml change;
#   the Dockerfile's wheel cache (a RUN cache mount, /var/tmp/buildah-cache/ here).
# Runs as root, as CI does: `podman build --isolation chroot` needs no daemon, no cgroups
# and no user namespaces.
set -euo pipefail
cd "$(dirname "$0")/.."

FLAVOUR=cpu
TAG=""
while [ $# -gt 0 ]; do
  case "$1" in
    --flavour) FLAVOUR=$2; shift 2 ;;
    --tag) TAG=$2; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "build_image.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

CACHE=${SPLITSERVE_IMAGE_CACHE:-$HOME/.cache/splitserve-image}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
# The image's version is the chart's appVersion (tests/image checks the package agrees).
VERSION=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' charts/splitserve/Chart.yaml)
[ -n "$VERSION" ] || { echo "build_image.sh: no appVersion in charts/splitserve/Chart.yaml" >&2; exit 1; }

case "$FLAVOUR" in cpu|gpu) ;; *) echo "build_image.sh: --flavour must be cpu or gpu, got '$FLAVOUR'" >&2; exit 2 ;; esac
command -v podman >/dev/null || { echo "build_image.sh: podman is missing (scripts/setup.sh installs it)" >&2; exit 1; }
mkdir -p "$CACHE"
build_args=(--build-arg "FLAVOUR=$FLAVOUR" --build-arg "TORCH_VERSION=$TORCH_VERSION" --build-arg "VERSION=$VERSION")
[ -z "${PIP_EXTRA_INDEX_URL:-}" ] || build_args+=(--build-arg "PIP_EXTRA_INDEX_URL=$PIP_EXTRA_INDEX_URL")
# What the build's pip needs from this machine, mounted at /mnt for the build only: the CA
# bundle this machine's pip trusts (PIP_CERT or pip's `cert` setting, e.g. a TLS-intercepting
# proxy's) and, for the CPU flavour, the torch wheel.
extras="$CACHE/build-mnt-$FLAVOUR"
mkdir -p "$extras/wheels"
ca=${PIP_CERT:-$("$PYTHON" -m pip config list 2>/dev/null | sed -n "s/^.*\.cert='\(.*\)'$/\1/p" | tail -n 1)}
rm -f "$extras/ca.pem"
if [ -n "$ca" ] && [ -f "$ca" ]; then
  cp "$ca" "$extras/ca.pem"
  build_args+=(--build-arg "PIP_CERT=/mnt/ca.pem")
fi
build_args+=(--build-arg "PIP_FIND_LINKS=/mnt/wheels")

case "$FLAVOUR" in
  cpu)
    BASE=localhost/splitserve-base:bookworm
    rootfs="$CACHE/bookworm-minbase.tar"
    if [ ! -f "$rootfs" ] || [ -n "$(find "$rootfs" -mtime +7)" ]; then
      command -v mmdebstrap >/dev/null || { echo "build_image.sh: mmdebstrap is missing (scripts/setup.sh installs it)" >&2; exit 1; }
      echo "build_image.sh: bootstrapping Debian bookworm (minbase) -> $rootfs"
      mmdebstrap --quiet --variant=minbase --format=tar bookworm "$rootfs.part"
      mv "$rootfs.part" "$rootfs"
      podman rmi --force "$BASE" >/dev/null 2>&1 || true
    fi
    if ! podman image exists "$BASE"; then
      podman import --quiet "$rootfs" "$BASE" >/dev/null
    fi
    # The CPU build of torch for the image's Python (bookworm: 3.11), fetched once.
    wheels="$extras/wheels"
    if ! ls "$wheels"/torch-"$TORCH_VERSION"+cpu-cp311-*.whl >/dev/null 2>&1; then
      echo "build_image.sh: fetching torch==$TORCH_VERSION+cpu"
      if ! "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$wheels" \
           --python-version 3.11 --implementation cp --abi cp311 \
           --platform "manylinux_2_28_$(uname -m)" "torch==$TORCH_VERSION+cpu"; then
        echo "build_image.sh: no CPU build of torch $TORCH_VERSION reachable by pip here;" \
             "set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" >&2
        exit 1
      fi
    fi
    TAG=${TAG:-localhost/splitserve:$VERSION-cpu}
    ;;
  gpu)
    BASE=${GPU_BASE_IMAGE:-docker.io/nvidia/cuda:13.0.3-base-ubuntu24.04}
    TAG=${TAG:-localhost/splitserve:$VERSION}
    ;;
esac

echo "build_image.sh: building $TAG (flavour $FLAVOUR, base $BASE, splitserve $VERSION)"
start=$SECONDS
podman build --isolation chroot --layers --build-arg "BASE_IMAGE=$BASE" "${build_args[@]}" \
  --volume "$extras:/mnt:ro" --tag "$TAG" --file Dockerfile .
# What earlier builds left untagged (older images, the end of each build-only stage) goes;
# the layers the cache builds on are parents of the new image and stay.
podman image prune --force --filter "label=org.opencontainers.image.title=splitserve" >/dev/null
echo "build_image.sh: built $TAG in $((SECONDS - start)) s"
