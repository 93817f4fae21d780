"""What the node helper's tests (tests/unit/test_node_*.py) share: the built dsc_node.pyz run as the
nodes run it, and a stand-in for DeepSpeed's launcher to start. The tests import it as
tests.unit.node_helpers: the repository root is on the import path through the control venv's
dscluster.pth, as for train and plugins."""
import subprocess
import sys
import time
from pathlib import Path

import dscplan

ROOT = Path(__file__).resolve().parents[2]
HELPER = dscplan.node_helper(ROOT)[0]  # the file the nodes run, built as the plan builds it


def helper(*args, stdin=None, env=None):
    return subprocess.run([sys.executable, str(HELPER), *map(str, args)], input=stdin, text=True,
                          capture_output=True, timeout=60, env=env)


def wait_for(path, seconds=20):
    deadline = time.time() + seconds
    while time.time() < deadline and not path.exists():
        time.sleep(0.1)
    return path.exists()


def launcher_script(tmp_path, body):
    """A stand-in for DeepSpeed's launcher: start puts --master_port N right after it."""
    path = tmp_path / f"launcher-{abs(hash(body))}.sh"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path
