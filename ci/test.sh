#!/usr/bin/env bash
# README set-up command (b): install everything, then run the full test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
exec .venv/bin/python -m pytest -q -ra "$@"
