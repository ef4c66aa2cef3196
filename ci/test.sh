#!/usr/bin/env bash
# README set-up command (b): install everything, then run the full test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
export KVPLUGINS_SOAK_OPS=${KVPLUGINS_SOAK_OPS:-20000}   # tests/store/test_soak.py at the issue's 8 x 20k ops
exec .venv/bin/python -m pytest -q -ra --durations=40 "$@"
