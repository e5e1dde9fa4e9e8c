#!/usr/bin/env bash
# Packs what the GPU check needs beyond a CUDA machine's PyTorch stack, for a GPU machine that
# cannot reach a package index (the lent H100/H200 of issue 20): Python 3.12 x86-64 wheels of
# Ray, the Mooncake Transfer Engine (non-CUDA build), llguidance, jsonschema and its parts,
# gRPC/protobuf, peft with accelerate (the reference of the lora_peft check), openai-harmony with
# pydantic and the verified o200k_base.tiktoken it would download (tiktoken/), the openai client
# (bench/gpu/gpt_oss_20b.py), at the
# versions this project's venv runs, unpacked and trimmed of what the
# serving path never loads (Ray's Java jar, dashboard build, rllib/data/serve/tune/train/llm;
# Mooncake's store, master, client and bench binaries), plus the system libraries Mooncake
# links (libibverbs, libnuma, libnl; libcurl and its closure in syslibs/curl). ~48 MB, xz.
#   bench/gpu/pack_deps.sh [OUT]       -> OUT (default .gpucarry/site312.tar.xz)
# On the GPU machine, in the repository:
#   tar xJf site312.tar.xz -C /tmp
#   export PYTHONPATH=/tmp/site312:$PWD LD_LIBRARY_PATH=/tmp/syslibs TIKTOKEN_ENCODINGS_BASE=/tmp/tiktoken
#   ldconfig -p | grep -q "libcurl.so.4 " || export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:/tmp/syslibs/curl
#   PYTHON=python3 bench/gpu/run_short.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-.gpucarry/site312.tar.xz}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/wheels" "$WORK/site312" "$WORK/syslibs/curl" "$(dirname "$OUT")"

# the versions this project's tests run (llguidance: the newest with a cp312 wheel if that one has none)
SPECS=$("$PY" - <<'EOF'
from importlib import metadata
names = ["ray", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
         "mooncake-transfer-engine-non-cuda", "grpcio", "grpcio-tools", "protobuf",
         "peft", "accelerate",  # pure Python: the lora_peft check (transformers is on the machine)
         # the router imports openai-harmony (gpt-oss's chat format, router/harmony.py), which needs pydantic
         "openai-harmony", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
         # the openai client of bench/gpu/gpt_oss_20b.py's chat checks
         "openai", "httpx2", "httpcore2", "h11", "truststore", "anyio", "sniffio", "jiter", "idna",
         "typing-extensions"]  # pydantic and openai want a newer one than a CUDA image may have
print(" ".join(f"{n}=={metadata.version(n)}" for n in names))
EOF
)
PLATFORMS=""
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS="$PLATFORMS --platform ${p}_x86_64"
done
fetch() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLATFORMS -d "$WORK/wheels" "$@"; }
for spec in $SPECS; do fetch "$spec"; done
LLG=$("$PY" -c "from importlib import metadata; print(metadata.version('llguidance'))")
fetch "llguidance==$LLG" 2>/dev/null || fetch llguidance
for w in "$WORK"/wheels/*.whl; do unzip -q -o "$w" -d "$WORK/site312"; done
# openai-harmony's o200k vocabulary, which it would download: the verified copy (core/harmony_vocab.py)
"$PY" -c "import sys; from pathlib import Path; from splitserve.core.harmony_vocab import write_o200k; write_o200k(Path(sys.argv[1]))" "$WORK/tiktoken"

cd "$WORK/site312"
rm -rf ray/jars ray/dashboard/client/build ray/rllib ray/data ray/serve ray/tune ray/train ray/llm \
  mooncake/transfer_engine_bench mooncake/mooncake_client mooncake/mooncake_master mooncake/store.so \
  mooncake_transfer_engine_non_cuda.libs/libetcd_wrapper-*.so  # engine.so finds mooncake/libetcd_wrapper.so first
find . -name "*.js.map" -delete
cd - >/dev/null

LIB=/lib/x86_64-linux-gnu
for l in libibverbs.so.1 libnuma.so.1 libnl-3.so.200 libnl-route-3.so.200; do cp -L "$LIB/$l" "$WORK/syslibs/"; done
cp -L "$LIB/libcurl.so.4" "$WORK/syslibs/curl/"
ldd "$LIB/libcurl.so.4" | awk '{print $3}' | grep -vE "^$|libc\.so|libm\.so|libpthread|libdl\.so|ld-linux|librt|libresolv" \
  | while read -r l; do cp -L "$l" "$WORK/syslibs/curl/"; done

tar cf - -C "$WORK" site312 syslibs tiktoken | xz -T0 -9 > "$OUT"
ls -la "$OUT"
