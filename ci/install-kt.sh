#!/usr/bin/env bash
# Install kt-kernel 0.7.2 for benchmarks/moe_bench.py ONLY, into .venv/kt-kernel-0.7.2 (a --target dir the
# benchmark puts on sys.path; never site-packages, so it never shadows or is shadowed by the `kvplugins kt` shim).
# --no-deps: kt-kernel 0.7.2 pins torch==2.9.1 (a CUDA build from PyPI); its extension is not linked to torch
# and runs with the venv's torch 2.13.0+cpu. Its other runtime imports are installed from ci/constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TARGET=.venv/kt-kernel-0.7.2
if [ ! -d "$TARGET/kt_kernel" ]; then
  $PY -m pip install -q --no-deps --target "$TARGET" kt-kernel==0.7.2
fi
$PY -m pip install -q -c ci/constraints.txt safetensors gguf pyyaml typer httpx packaging 2>/dev/null \
  || $PY -m pip install -q safetensors gguf pyyaml typer httpx packaging
echo "kt-kernel 0.7.2 in $TARGET"
