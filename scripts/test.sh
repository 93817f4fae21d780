#!/usr/bin/env bash
# The whole test suite, from a fresh machine: the unit tier first (tests/unit: the plan, the node
# helper, train/config.py; seconds, no containers), then it installs what the container tier needs
# (podman, runc, debootstrap from apt; the node image; the offline wheelhouse; a CPU
# torch+DeepSpeed venv for train/) and runs pytest over molecule/tests against a container cluster
# it starts itself.
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
export CONTAINERS_CONF=$PWD/scripts/containers.conf
echo "== control venv";   bash scripts/setup-control.sh
echo "== unit tests (tests/unit)"
set +e
.venv/bin/pytest tests/unit -q -rs
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no unit tests: that is a failure"; exit 1; fi
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
need=()
for tool in podman runc debootstrap ssh-keygen rsync; do command -v "$tool" >/dev/null || need+=("$tool"); done
if [ ${#need[@]} -gt 0 ]; then
  echo "== installing podman runc debootstrap openssh-client rsync"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap openssh-client rsync >/dev/null
fi
echo "== wheelhouse";     REQUIREMENTS_FILE=tests/fixtures/scripts/requirements.txt bash scripts/wheelhouse.sh
echo "== node image";     bash scripts/build-image.sh
# What the tests install beside the wheelhouse, fetched here so that the tests themselves reach
# only their own containers: DeepSpeed's source archive as PyPI has it and wheel (the index test;
# a source build without a pyproject.toml needs wheel beside setuptools), and another version of
# packaging than the wheelhouse's (the version-skew preflight test).
if [ ! -d .cache/test-packages ]; then
  echo "== test packages (.cache/test-packages)"
  . requirements/pins.env
  fetch() { .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps -d .cache/test-packages.part "$@"; }
  fetch --no-binary :all: "deepspeed==$DEEPSPEED_VERSION"
  fetch --only-binary :all: wheel packaging==26.3
  mv .cache/test-packages.part .cache/test-packages
fi
if [ ! -x .cache/train-venv/bin/deepspeed ]; then
  echo "== train venv (offline, from the wheelhouse)"
  python3 -m venv .cache/train-venv
  .cache/train-venv/bin/pip install -q --no-index --find-links .cache/wheelhouse torch deepspeed
fi
echo "== removing what an earlier, killed run left behind"
.venv/bin/python molecule/cluster.py down
echo "== tests"
rm -f .cache/test-figures.jsonl
set +e
.venv/bin/pytest molecule/tests -v -rs --durations=0 --durations-min=15 "$@"
rc=$?
set -e
echo "== figures the tests measured (.cache/test-figures.jsonl)"
if [ -f .cache/test-figures.jsonl ]; then cat .cache/test-figures.jsonl; else echo "(none: no test that records figures ran)"; fi
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: that is a failure"; exit 1; fi
exit "$rc"
