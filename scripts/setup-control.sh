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
# The project's own Python, importable by the paths scripts/import-paths.sh prints alone.
# Ansible's action and filter plugins, pytest and bench/ all run this venv's python, which reads
# the .pth at start. Written on every run, so a moved repository or a venv made before the file
# existed gets it without reinstalling.
purelib() { "$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'; }
write_paths() {
  sh "$here/scripts/import-paths.sh" "$here" > "$(purelib)/dscluster.pth"
}
if [ -x "$venv/bin/ansible-playbook" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  write_paths
  echo "control venv $venv is up to date"; exit 0
fi
"$py" -m venv "$venv"
write_paths
# Every package pinned with its sha256 (scripts/lock.sh writes the lock from control.txt); a pip
# failure fails this script (only the "is ignored" notes of a site's unreachable extra index are
# left out of its output). Byte-compiled after, all but the bundled collections' 15,000 files:
# Ansible's collection loader compiles the few it loads from their source itself.
"$venv/bin/pip" install -q --disable-pip-version-check --require-hashes --no-deps --no-compile \
  -r "$here/requirements/control.lock" 2> >(grep -v 'is ignored' >&2)
"$venv/bin/python" -m compileall -qq -x '/ansible_collections/' "$(purelib)" || true
version=$("$venv/bin/ansible-playbook" --version); echo "${version%%$'\n'*}"
echo "$want" > "$stamp"
