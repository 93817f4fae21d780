#!/usr/bin/env bash
# The main job on the embedded default (this machine as a one-node cluster): control venv,
# offline wheelhouse, provision.yml, then a tiny GPT trained with launch.yml (zero2), followed
# to the end.  Run as root (provisioning installs packages and creates the training user).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-control.sh
bash scripts/wheelhouse.sh
.venv/bin/ansible-playbook provision.yml
.venv/bin/ansible-playbook launch.yml -e preset=zero2 -e follow=true "$@"
