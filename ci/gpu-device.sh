#!/usr/bin/env bash
# The GPU checks, run on a lent GPU machine (the `device` tool's nvidia-h200: torch with CUDA, nvcc, cmake,
# nanobind and scikit-build-core installed; no package index). Not part of CI (CI has no GPU).
#
# Prepare here, once per session (both folders are in .git/info/exclude and travel with `carry`):
#   .whl/     cp312 wheels of what that image lacks: pyzmq msgspec google-re2 etcd3gw futurist pbr debtcollector
#             (pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 ...)
#   .devsrc/include/xxhash.h   Debian's libxxhash-dev header (the native build includes it)
# Run there:   bash ci/gpu-device.sh        (results under $OUT: logs and staged_gpu.json)
set -uo pipefail
OUT=${OUT:-/tmp/kvp-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ lscpu | grep -E "Model name|^CPU\(s\)|Flags"; nvidia-smi -L; python3 -c "import torch; print(torch.__version__)"; } \
  > "$OUT/machine.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site
t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . \
  -C cmake.define.XXHASH_INCLUDE_DIR="$PWD/.devsrc/include" > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "native build + install: $((SECONDS - t0)) s"
timeout 240 python3 -m pytest tests/gpu -ra -p no:randomly -p no:cacheprovider -v 2>&1 | tee "$OUT/gpu_tests.log"
echo "tests/gpu rc=$?"
timeout 150 python3 benchmarks/staged_gpu.py --pages 256 --repeat 5 --json "$OUT/staged_gpu.json" 2>&1 \
  | tee "$OUT/staged_gpu.log"
echo "staged_gpu rc=$?"
timeout 150 python3 -m pytest tests/kt -q -ra -p no:randomly -p no:cacheprovider 2>&1 \
  | tail -40 | tee "$OUT/kt_tiers.log"
echo "kt tiers rc=$?"
