#!/usr/bin/env bash
# Create the control-node virtualenv (.venv) with the tools of requirements/control.txt, installed
# from their hashed lock (requirements/control.lock).
#   scripts/setup-control.sh && . .venv/bin/activate
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${DSC_VENV:-$here/.venv}
py=${PYTHON:-python3}
stamp="$venv/.requirements.sha256"
# Ansible's fact cache (ansible.cfg) holds the nodes' facts: the control node's user alone reads it.
install -d -m 0700 "$here/.cache/facts" && chmod -R go-rwx "$here/.cache/facts"
want=$(sha256sum "$here/requirements/control.lock" | cut -d' ' -f1)
if [ -x "$venv/bin/ansible-playbook" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "control venv $venv is up to date"; exit 0
fi
"$py" -m venv "$venv"
# Every package pinned with its sha256 (scripts/lock.sh writes the lock from control.txt); a pip
# failure fails this script (only the "is ignored" notes of a site's unreachable extra index are
# left out of its output).
"$venv/bin/pip" install -q --disable-pip-version-check --require-hashes --no-deps \
  -r "$here/requirements/control.lock" 2> >(grep -v 'is ignored' >&2)
version=$("$venv/bin/ansible-playbook" --version); echo "${version%%$'\n'*}"
echo "$want" > "$stamp"
