"""plugins/callback/dsc_preload.py: at a playbook's start, with the project's ansible.cfg, every
Jinja filter and test plugin file (Ansible's and the project's) is loaded in the playbook's own
process, where the workers forked for each task inherit it."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A fresh interpreter, as ansible-playbook starts: its plugin loader, then the callback's hook.
PLAYBOOK_START = """
import json, sys
from ansible.plugins.loader import init_plugin_loader
init_plugin_loader()
before = set(sys.modules)
from plugins.callback import dsc_preload
dsc_preload.CallbackModule().v2_playbook_on_start(None)
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_the_filter_and_test_plugins_are_loaded_before_any_worker_forks():
    r = subprocess.run([sys.executable, "-c", PLAYBOOK_START], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env=dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg")))
    assert r.returncode == 0, r.stderr[-3000:]
    # The loader names each file's module after the file and a hash of its path.
    loaded = {m.rsplit("_", 1)[0] for m in json.loads(r.stdout.splitlines()[-1])}
    project = {f"ansible.plugins.filter.{f.stem}" for f in (ROOT / "plugins" / "filter").glob("*.py")}
    assert project and project <= loaded, sorted(loaded)
    assert {"ansible.plugins.filter.core", "ansible.plugins.test.core"} <= loaded, sorted(loaded)
