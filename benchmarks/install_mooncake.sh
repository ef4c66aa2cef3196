#!/usr/bin/env bash
# Installs what `store_bench.py --vs mooncake` needs into ./.venv: libibverbs1 (Mooncake's engine links it, even
# for TCP), iproute2 (ip netns) and the CPU-only Mooncake wheel, under ci/constraints.txt so no CUDA torch comes in.
set -euo pipefail
type quiet_pip >/dev/null 2>&1 || quiet_pip() { "$@"; }    # ci/install.sh exports one that explains pip's expected notes
cd "$(dirname "$0")/.."
VENV=${KVPLUGINS_VENV:-.venv}
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  need=()
  for p in iproute2 libibverbs1; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
  if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
fi
quiet_pip "$VENV/bin/python" -m pip install -q -c ci/constraints.txt "mooncake-transfer-engine-non-cuda==0.3.13.post1"
"$VENV/bin/python" -c "from mooncake.store import MooncakeDistributedStore; print('mooncake store OK')"
