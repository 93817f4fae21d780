#!/usr/bin/env bash
# The whole test suite, from a fresh machine (it installs what each tier needs), in three tiers:
#   unit       tests/unit      pure logic: the plan, the node helper, train/config; first, and its
#                              failure stops the rest
#   local      tests/local     no container: train/ on 2 CPU ranks, ansible-lint, ruff; at low
#                              priority, in the CPU the container tier leaves idle
#   container  molecule/tests  real nodes: podman containers over SSH, two clusters at once
#                              (pytest-xdist, a cluster per worker)
# The suite fails if any tier does. scripts/suite.py runs it: the set-up steps beside each other
# (venvs, wheelhouse, podman, the node images), the tiers, and where the time went
# (.cache/suite-times.jsonl, one line per run).
#   bash scripts/test.sh [pytest args for the container tier]
#   DSC_TIERS="unit local" bash scripts/test.sh     # only these tiers
#   DSC_DRY_RUN=1 bash scripts/test.sh              # print the steps and their commands, run nothing
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "scripts/test.sh needs python3 3.11 or newer on PATH" >&2; exit 1
fi
exec python3 scripts/suite.py "$@"
