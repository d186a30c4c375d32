#!/usr/bin/env bash
# Wheels the serving stack needs on the GPU machine, for benchmarks/gpu_check.py (docs/gpu.md,
# "Checking a GPU"). That machine has Python 3.12 with PyTorch, Triton, transformers, tokenizers,
# safetensors, numpy, msgpack, anyio, h11, click, httpx, prometheus-client, rich and tqdm
# (/work/.library/device/KINDS.md lists them), no network, and none of the rest below: they are
# downloaded here (pip download, no dependencies resolved: each one named) into DEST (default
# .whl, ignored by git), and carried with the run (`carry: [".whl"]`), about 10 MiB in all.
# The versions are those of this project's lock-step virtual environment.
#
#   bash benchmarks/gpu_check_setup.sh [DEST]
#
# Then, with the device tool (one call; see docs/gpu.md for the flags):
#   run(carry=[".whl"], timeout_s=590, command="python3 -m pip install -q --no-index --no-deps --no-compile
#       --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;
#       PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --output $OUT/gpu_check.json")
set -euo pipefail
dest="${1:-.whl}"
if [ "$dest" = ".whl" ] && common=$(git rev-parse --git-common-dir 2>/dev/null); then
    grep -qx '/.whl/' "$common/info/exclude" 2>/dev/null || echo '/.whl/' >>"$common/info/exclude"
fi
mkdir -p "$dest"
wheels=(
    pyzmq==27.3.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 sniffio==1.3.1
    jsonschema==4.25.1 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
    xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 opentelemetry-api==1.45.2 typing-extensions==4.16.0
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dest" "${wheels[@]}"
du -sh "$dest"
