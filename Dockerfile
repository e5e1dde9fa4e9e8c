# The one splitserve image: router, decode worker, prefill pool (Ray head and workers) and
# the operator all run it. Build it with scripts/build_image.sh (docs/image.md), which CI
# and the release workflow both use.
#
# Flavours, chosen by build arguments:
#   cpu: BASE_IMAGE = Debian bookworm (python3.11), FLAVOUR=cpu -> torch==X+cpu
#   gpu: BASE_IMAGE = nvidia/cuda:13.0.3-base-ubuntu24.04 (python3.12), FLAVOUR=gpu ->
#        torch==X from PyPI, the CUDA build (2.13: CUDA 13.0). NVIDIA's base image brings
#        the CUDA runtime and the settings the NVIDIA container toolkit reads; torch brings
#        cuBLAS, cuDNN and NCCL as pip packages, so the larger -runtime image would carry
#        them twice.
# The base is an argument because no registry may be reachable where it is built: CI
# bootstraps a local Debian with mmdebstrap and passes its name.
#
# Under Kubernetes' readOnlyRootFilesystem the only writable place is /tmp (the chart and
# the operator mount an emptyDir there): HOME and every cache point under it.

ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim

# -- base: the OS packages every component needs, and the non-root user ------------------
FROM ${BASE_IMAGE} AS base
ARG DEBIAN_FRONTEND=noninteractive
# On every stage, so the build script can prune this build's leftovers by it.
LABEL org.opencontainers.image.title="splitserve"
# bash: the KubeRay pods' command; wget: KubeRay's exec probes on Ray pods; libibverbs1:
# the Mooncake Transfer Engine links against it even in tcp mode; g++: the native CPU decode
# attention is compiled for the node's CPU on first use (splitserve/kernels/cpu_native.py),
# and Triton builds its GPU launcher with the C compiler; tcmalloc: preloaded into CPU engine
# processes (splitserve/engine/allocator.py; Ubuntu 24.04 names it libtcmalloc-minimal4t64).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv bash ca-certificates wget libibverbs1 g++ \
 && (apt-get install -y --no-install-recommends libtcmalloc-minimal4 \
     || apt-get install -y --no-install-recommends libtcmalloc-minimal4t64) \
 && rm -rf /var/lib/apt/lists/*
# UID/GID 1000 is what the chart and the operator run pods as (runAsUser). Ubuntu images
# already have a user 1000 ("ubuntu"): it makes way.
RUN if getent passwd 1000 >/dev/null; then userdel "$(getent passwd 1000 | cut -d: -f1)"; fi \
 && if getent group 1000 >/dev/null; then groupdel "$(getent group 1000 | cut -d: -f1)"; fi \
 && groupadd --gid 1000 splitserve \
 && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin splitserve

# -- requirements: the runtime dependencies out of pyproject.toml -------------------------
# Its own stage so the dependency layers below are rebuilt only when these change, not when
# the version or the test extras do (scripts/image_requirements.py says what is left out).
FROM base AS requirements
ARG FLAVOUR=cpu
COPY pyproject.toml scripts/image_requirements.py /src/
RUN python3 /src/image_requirements.py /src/pyproject.toml "$FLAVOUR" > /requirements.txt

# -- deps: a virtualenv with torch (the flavour's build) and every dependency -------------
FROM base AS deps
ARG FLAVOUR=cpu
ARG TORCH_VERSION=2.13.0
# pip settings for the build only (build arguments are not in the image's environment):
# PIP_EXTRA_INDEX_URL where the CPU build of torch is when not on the default index, e.g.
# https://download.pytorch.org/whl/cpu; PIP_FIND_LINKS a wheel directory; PIP_CERT a CA
# bundle for builds behind a TLS-intercepting proxy. scripts/build_image.sh mounts its
# wheels and CA at /mnt (empty in the base, so no mount point is left in the image).
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_FIND_LINKS=""
ARG PIP_CERT=""
ENV VIRTUAL_ENV=/opt/splitserve PATH=/opt/splitserve/bin:$PATH
RUN python3 -m venv /opt/splitserve
# pip downloads into a wheel cache that outlives the build (a cache mount; with podman it
# stays on the building machine) and installs from it offline. A wheel cache rather than
# pip's HTTP cache, which proxies defeat by dropping the caching headers. One directory per
# flavour: torch 2.13.0+cpu would otherwise win over 2.13.0 in the gpu build.
# torch first and pinned, so nothing after it can pull another build; then a check that
# the build matches the flavour (a CUDA torch in the CPU image would be 3 GB of dead weight).
RUN --mount=type=cache,target=/var/cache/splitserve-wheels \
    case "$FLAVOUR" in \
      cpu) spec="torch==${TORCH_VERSION}+cpu" ;; \
      gpu) spec="torch==${TORCH_VERSION}" ;; \
      *) echo "FLAVOUR must be cpu or gpu, got '$FLAVOUR'" >&2; exit 1 ;; \
    esac \
 && pip download --quiet --dest "/var/cache/splitserve-wheels/$FLAVOUR" "$spec" \
 && pip install --no-cache-dir --no-index --find-links "/var/cache/splitserve-wheels/$FLAVOUR" "$spec" \
 && python -c "import sys, torch; cuda = torch.version.cuda; \
print('torch', torch.__version__, 'cuda', cuda); \
sys.exit(0 if (cuda is None) == ('$FLAVOUR' == 'cpu') else 'torch build does not match FLAVOUR=$FLAVOUR')"
COPY --from=requirements /requirements.txt /opt/splitserve/requirements.txt
RUN --mount=type=cache,target=/var/cache/splitserve-wheels \
    pip download --quiet --dest "/var/cache/splitserve-wheels/$FLAVOUR" -r /opt/splitserve/requirements.txt \
 && pip install --no-cache-dir --no-index --find-links "/var/cache/splitserve-wheels/$FLAVOUR" \
        -r /opt/splitserve/requirements.txt

# -- wheel: splitserve itself, with its generated gRPC modules ----------------------------
FROM deps AS wheel
COPY pyproject.toml README.md /src/
COPY splitserve /src/splitserve
WORKDIR /src
# No build isolation: setuptools came with torch, so this stage needs no network.
RUN python -m splitserve.proto.build --force \
 && pip wheel --no-deps --no-build-isolation --wheel-dir /dist /src

# -- runtime: deps + the splitserve wheel, as the non-root user ---------------------------
FROM deps AS runtime
# The chart's appVersion (the build script passes it): the package must report the same.
ARG VERSION=""
# COPY, not a bind mount from the stage: a COPY's cache key is the content, so a changed
# source rebuilds this layer (a RUN --mount's content is not part of the key).
COPY --from=wheel /dist/ /opt/splitserve/dist/
RUN pip install --no-cache-dir --no-deps /opt/splitserve/dist/splitserve-*.whl \
 && if [ -n "$VERSION" ] && [ "$(splitserve --version)" != "splitserve $VERSION" ]; then \
      echo "splitserve --version says '$(splitserve --version)', the chart's appVersion is $VERSION" >&2; exit 1; \
    fi
# Every writable path under /tmp (see the header); bytecode was compiled at install time.
ENV HOME=/tmp \
    XDG_CACHE_HOME=/tmp/cache \
    SPLITSERVE_CACHE=/tmp/cache/splitserve \
    HF_HOME=/tmp/cache/huggingface \
    TRITON_CACHE_DIR=/tmp/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/cache/torchinductor \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
LABEL org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/splitserve/splitserve" \
      org.opencontainers.image.description="Disaggregated prefill/decode LLM serving: router, workers, operator"
USER 1000:1000
WORKDIR /tmp
VOLUME ["/tmp"]
ENTRYPOINT ["splitserve"]
CMD ["serve", "--host", "0.0.0.0"]
