#!/usr/bin/env bash
# Create the control-node virtualenv (.venv) with the pinned tools in requirements/control.txt.
#   scripts/setup-control.sh && . .venv/bin/activate
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${DSC_VENV:-$here/.venv}
py=${PYTHON:-python3}
stamp="$venv/.requirements.sha256"
want=$(sha256sum "$here/requirements/control.txt" | cut -d' ' -f1)
if [ -x "$venv/bin/ansible-playbook" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "control venv $venv is up to date"; exit 0
fi
"$py" -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check -r "$here/requirements/control.txt" 2>&1 \
  | grep -v 'is ignored' || true
version=$("$venv/bin/ansible-playbook" --version); echo "${version%%$'\n'*}"
echo "$want" > "$stamp"
