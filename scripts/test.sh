#!/usr/bin/env bash
# The whole test suite, from a fresh machine, in three tiers:
#   unit       tests/unit: pure logic (the plan, the node helper, train/config.py); seconds, nothing installed
#   local      tests/local: what needs no container (train/ on 2 CPU ranks here, ansible-lint, ruff)
#   container  molecule/tests: what needs real nodes (a cluster of podman containers over SSH)
# The unit tier first (its failure stops the rest); the local tier at low priority beside the
# provisioned image's build and the container tier; the suite fails if any tier does.
# It installs what each tier needs (the control venv; the offline wheelhouse and a CPU
# torch+DeepSpeed venv; podman, runc and mmdebstrap from apt and the node images), the downloads
# beside the control venv, the unit tier and each other, and ends with where the time went
# (scripts/timings.py over .cache/timings.jsonl).
#   bash scripts/test.sh [pytest args for the container tier]
#   DSC_TIERS="unit local" bash scripts/test.sh     # only these tiers
set -euo pipefail
cd "$(dirname "$0")/.."
export CONTAINERS_CONF=$PWD/molecule/containers.conf
export DSC_TIMINGS=$PWD/.cache/timings.jsonl
tiers=${DSC_TIERS:-unit local container}
mkdir -p .cache && rm -f "$DSC_TIMINGS"
# The local tier's cgroup (low_priority), under cgroup v1's cpu hierarchy or v2's root.
low_groups=(/sys/fs/cgroup/cpu/dsc-tests-$$ /sys/fs/cgroup/dsc-tests-$$)

# phase NAME COMMAND...: run it and record its wall seconds. A failure ends the script, as
# errexit does; where errexit is off (`phase ... || status=$?`), it is phase's exit status.
phase() {
  local name=$1 t0; shift
  t0=$(date +%s%N)
  echo "== $name"
  "$@"
  local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '{"kind": "phase", "name": "%s", "seconds": %d.%03d}\n' "$name" $((ms / 1000)) $((ms % 1000)) >>"$DSC_TIMINGS"
  return "$rc"
}
# tier NAME PYTEST-ARGS...: pytest over one tier; collecting no test is a failure.
tier() {
  local name=$1 rc=0; shift
  .venv/bin/pytest "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then echo "pytest collected no tests in the $name tier: that is a failure"; return 1; fi
  return "$rc"
}
t_start=$(date +%s%N)
summary() {
  local ms=$(( ($(date +%s%N) - t_start) / 1000000 ))
  printf '{"kind": "wall", "seconds": %d.%03d}\n' $((ms / 1000)) $((ms % 1000)) >>"$DSC_TIMINGS"
  # A tier that failed first leaves no background job behind (the image build), nor its children.
  kill_tree $(jobs -pr)
  rmdir "${low_groups[@]}" 2>/dev/null || true
  if [ -f .cache/test-figures.jsonl ]; then echo "== figures the tests measured"; cat .cache/test-figures.jsonl; fi
  echo "== where the time went ($DSC_TIMINGS)"
  [ -x .venv/bin/python ] && [ -f "$DSC_TIMINGS" ] && .venv/bin/python scripts/timings.py "$DSC_TIMINGS" || true
}
kill_tree() {
  local p c
  for p in "$@"; do
    for c in $(ps -o pid= --ppid "$p"); do kill_tree "$c"; done
    kill "$p" 2>/dev/null || true
  done
}
trap summary EXIT
wants() { [[ " $tiers " == *" $1 "* ]]; }

# start NAME LOG FUNCTION [ARGS]: run it in the background (errexit on, output to LOG); its exit
# status lands in .cache/jobs/NAME, so that any later job can wait for it (await).
start() {
  local name=$1 log=$2; shift 2
  ( set +e; ( set -e; "$@" ); echo $? >".cache/jobs/$name" ) >"$log" 2>&1 &
}
# await NAME LOG: wait for a started job and print its log; its exit status.
await() {
  while [ ! -f ".cache/jobs/$1" ]; do sleep 1; done
  cat "$2"
  return "$(cat ".cache/jobs/$1")"
}
rm -rf .cache/jobs && mkdir -p .cache/jobs

# What the container tier needs from outside: podman and its friends from apt and the node image
# from mmdebstrap (mostly downloads and dpkg) from the very start, beside the wheelhouse, the
# control venv and the unit tier: the provisioned image's build waits on them. The systemd node
# image (test_firewalld's nodes) is built on the node image beside the provisioned image's build,
# which does not need it.
node_tools() {
  local need=() tool
  for tool in podman runc mmdebstrap ssh-keygen rsync; do command -v "$tool" >/dev/null || need+=("$tool"); done
  if [ ${#need[@]} -gt 0 ]; then
    phase "podman runc mmdebstrap openssh-client rsync (apt)" bash -c 'apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap openssh-client rsync >/dev/null'
  fi
  phase "node image" bash molecule/build-image.sh base
}
systemd_node_image() {
  await node-tools .cache/node-tools.log >/dev/null
  phase "systemd node image (beside the provisioned image)" bash molecule/build-image.sh systemd
}
if wants container; then
  start node-tools .cache/node-tools.log node_tools
  start systemd-image .cache/systemd-image.log systemd_node_image
fi

# The suite's two venvs (the control venv: Ansible, pytest; the local tier's train venv: torch and
# DeepSpeed) on the distribution's Python where it is 3.11 or newer with venv and its headers:
# Debian's is built with PGO and LTO, a python3 built from source by default (pyenv's) is not, and
# the suite is CPU-bound (on Debian's 3.11.2 rather than pyenv's 3.11.7 the local tier's DeepSpeed
# processes took a quarter less CPU, Ansible's a sixteenth: docs/testing.md). PYTHON overrides it.
suite_python() {
  local p
  for p in /usr/bin/python3 python3; do
    if "$p" -c 'import ensurepip, os, sys, sysconfig, venv
sys.exit(sys.version_info < (3, 11) or not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' 2>/dev/null; then
      echo "$p"; return
    fi
  done
  echo python3
}
venv_python=${PYTHON:-$(suite_python)}

# The offline wheelhouse (downloads with the machine's own python3 and pip) from the start, beside
# the control venv and the unit tier.
if wants local || wants container; then
  start wheelhouse .cache/wheelhouse.log phase "wheelhouse (beside the control venv and the unit tier)" \
    env REQUIREMENTS_FILE=tests/fixtures/scripts/requirements.txt bash scripts/wheelhouse.sh
fi

phase "control venv" env PYTHON="$venv_python" bash scripts/setup-control.sh

# What the tests install beside the wheelhouse, fetched here (with the control venv's pip) so that
# the tests themselves reach only their own containers: DeepSpeed's source archive as PyPI has it
# and wheel (the index test; a source build without a pyproject.toml needs wheel beside
# setuptools), and another version of packaging than the wheelhouse's (the version-skew
# preflight test).
fetch_test_packages() {
  . requirements/pins.env
  local fetch=(.venv/bin/python -m pip download -q --disable-pip-version-check --no-deps -d .cache/test-packages.part)
  "${fetch[@]}" --no-binary :all: "deepspeed==$DEEPSPEED_VERSION"
  "${fetch[@]}" --only-binary :all: wheel packaging==26.3
  mv .cache/test-packages.part .cache/test-packages
}
if wants container && [ ! -d .cache/test-packages ]; then
  start test-packages .cache/test-packages.log phase "test packages (.cache/test-packages)" fetch_test_packages
fi

# The provisioned node image (provision.yml on one node of the bare image, committed), the longest
# thing before the container tier: it starts as soon as podman, the node images and the wheelhouse
# are there, beside the unit and local tiers.
provisioned_image() {
  await node-tools .cache/node-tools.log >/dev/null
  await wheelhouse .cache/wheelhouse.log >/dev/null
  for c in 0 1; do
    phase "removing what an earlier, killed run left behind (cluster $c)" env DSC_TEST_CLUSTER=$c .venv/bin/python molecule/cluster.py down
  done
  phase "provisioned node image (beside the unit and local tiers)" .venv/bin/python molecule/cluster.py image
}
if wants container; then start image .cache/image-build.log provisioned_image; fi

# low_priority: the calling (sub)shell, and all it starts, take the CPU that the rest leaves idle,
# and a twentieth of the machine when nothing is idle (so that no test of theirs waits without end).
# It moves into a cgroup of its own weighted 100 against the 1024 of each other (cgroup v1's cpu
# hierarchy; v2's weight 10 against 100), else runs at nice 19. Nice alone orders one session's
# processes only: the kernel weighs this script's session (its autogroup) and the containers'
# cgroup as one each, whatever the nice inside (docs/testing.md). The group goes at the end (summary).
low_priority() {
  local g
  for g in "${low_groups[@]}"; do
    [ -f "$(dirname "$g")/cgroup.procs" ] || continue
    if mkdir -p "$g" 2>/dev/null && { echo 100 >"$g/cpu.shares" || echo 10 >"$g/cpu.weight"; } 2>/dev/null &&
       echo "$BASHPID" >"$g/cgroup.procs" 2>/dev/null; then
      echo "== at low priority (cgroup $g)"; return
    fi
    rmdir "$g" 2>/dev/null || true
  done
  renice -n 19 -p "$BASHPID" >/dev/null
  echo "== at nice 19 (no cgroup of its own could be made)"
}

# The local tier, at low priority from its start to its end: its torch and DeepSpeed first
# (offline, from the wheelhouse), its tests once the unit tier has passed, in the CPU that the
# provisioned image's build and then the container tier leave idle (a fifth of the machine while
# two clusters run). Neither waits for it: the image's build took 197-216 s beside it so, ~310
# beside it at the same priority (docs/testing.md).
local_tier() {
  low_priority
  await wheelhouse .cache/wheelhouse.log >/dev/null
  [ -x .cache/train-venv/bin/deepspeed ] || phase "train venv (offline, from the wheelhouse)" bash -c \
    '"$0" -m venv .cache/train-venv && .cache/train-venv/bin/pip install -q --no-index --find-links .cache/wheelhouse torch deepspeed' \
    "$venv_python"
  if wants unit; then await unit /dev/null; fi
  phase "local tier" tier local tests/local -v -rs --durations=5
}
if wants local; then start local .cache/local-tier.log local_tier; fi

# A failure here ends the script, and with it every job (summary).
if wants unit; then
  phase "unit tier" tier unit tests/unit -q -rs
  echo 0 >.cache/jobs/unit
fi

if wants local || wants container; then
  echo "== waiting for the wheelhouse (.cache/wheelhouse.log)"
  await wheelhouse .cache/wheelhouse.log
fi

# container_tier [pytest args]: with no args, the tier's files split between two clusters that run
# at once (DSC_TEST_CLUSTER 0 and 1: their own containers, network, state and pytest tmp dirs),
# each file on one cluster; with args (a -k, a file), one cluster runs what they select.
# SECOND_CLUSTER holds about half the tier's time, so that both clusters end together
# (scripts/timings.py prints each file's seconds; on 12-04 they ended within about 30 s).
SECOND_CLUSTER="test_faults test_run_control test_preflight test_doctor test_auto_step_down test_slurm"
container_tier() {
  local args=(-v -rs --durations=15 -p no:cacheprovider)
  if [ $# -gt 0 ]; then
    # Files or tests named (molecule/tests/...): those alone; else (a -k) the whole tier's files.
    local where=(molecule/tests) a
    for a in "$@"; do if [[ "$a" == molecule/tests/* ]]; then where=(); fi; done
    tier container "${where[@]}" "${args[@]}" "$@"
    return
  fi
  local first=() second=() f rc0=0 rc1=0
  for f in molecule/tests/test_*.py; do
    if [[ " $SECOND_CLUSTER " == *" $(basename "$f" .py) "* ]]; then second+=("$f"); else first+=("$f"); fi
  done
  DSC_TEST_CLUSTER=1 tier "container (cluster 1)" "${second[@]}" "${args[@]}" --basetemp=.cache/pytest-tmp1 \
    >.cache/container-tier-1.log 2>&1 &
  local second_job=$!
  DSC_TEST_CLUSTER=0 tier "container (cluster 0)" "${first[@]}" "${args[@]}" --basetemp=.cache/pytest-tmp0 || rc0=$?
  wait "$second_job" || rc1=$?
  echo "== container tier, cluster 1 (.cache/container-tier-1.log)"
  cat .cache/container-tier-1.log
  [ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ]
}

if wants container; then
  echo "== waiting for podman and the node images (.cache/node-tools.log)"
  await node-tools .cache/node-tools.log
  await systemd-image .cache/systemd-image.log
  [ -d .cache/test-packages ] || await test-packages .cache/test-packages.log
fi
# The container tier as soon as the image is there (the systemd layer on it beside the tier's
# start: test_slurm's nodes, which wait for it); the local tier's end after it, whichever failed:
# the suite's status is every part's.
status=0
if wants container; then
  echo "== waiting for the provisioned node image (.cache/image-build.log)"
  await image .cache/image-build.log
  start systemd-layer .cache/systemd-layer.log phase "systemd layer on the provisioned image (beside the container tier)" \
    .venv/bin/python molecule/cluster.py systemd-layer
  rm -f .cache/test-figures.jsonl
  phase "container tier" container_tier "$@" || status=$?
  echo "== the systemd layer (.cache/systemd-layer.log)"
  await systemd-layer .cache/systemd-layer.log || status=$?
fi
if wants local; then
  echo "== waiting for the local tier (.cache/local-tier.log)"
  await local .cache/local-tier.log || status=$?
fi
exit "$status"
