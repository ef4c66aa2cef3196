#!/usr/bin/env bash
# Installs SGLang's router (sglang-router 0.3.2: a Rust binary in a Python wheel, no dependencies it needs at run
# time here) into .bench/sglang-router, apart from the venv, for `router_bench.py --routings sglang_cache_aware`:
# its cache-aware policy (an approximate radix tree of each worker's requests, with load-balance thresholds) is
# the baseline issue #37 asks for.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVPLUGINS_VENV:-.venv}
DEST=.bench/sglang-router
"$VENV/bin/python" -m pip install -q --no-deps --target "$DEST" "sglang-router==0.3.2" 2>&1 | grep -v "^WARNING: Location" || true
PYTHONPATH="$DEST" "$VENV/bin/python" -c "import sglang_router; print('sglang-router OK')"
