"""The node helper's package (node/dscnode) and the one file built from it (dsc_node.pyz): the
build gives the same bytes every time, the built file runs as python3's script and as a command,
and the entry shim from it leaves a user's script the sys.path that `python FILE` gives.

    .venv/bin/pytest tests/unit/test_node_build.py -q
"""
import ast
import graphlib
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import dscplan
from dscnode import INSTALLED_PATH
from dscnode.build import SHEBANG, build

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "node" / "dscnode"
HELPER = dscplan.node_helper(ROOT)[0]
# What the probe printed before the package (its keys: the plan reads them).
PROBE_KEYS = {"hostname", "cpus", "memory_mib", "cpu", "ssh_host_keys", "gpus", "interfaces", "link_speeds", "infiniband", "rdma", "runs", "run_root_links", "helper_sha256",
              "systemd", "rsync", "refused_reads",
              "firewalls"}


def test_the_build_gives_the_same_bytes_every_time(tmp_path):
    first, second = tmp_path / "a" / "dsc_node.pyz", tmp_path / "b" / "dsc_node.pyz"
    assert build(first) == build(second) == hashlib.sha256(first.read_bytes()).hexdigest()
    assert first.read_bytes() == second.read_bytes() and first.read_bytes().startswith(SHEBANG)
    assert oct(first.stat().st_mode & 0o777) == "0o755"
    # The plan's build is the same file, and it is named what it is installed as.
    assert dscplan.node_helper(ROOT)[1] == build(first)
    assert Path(HELPER).name == Path(INSTALLED_PATH).name == "dsc_node.pyz"
    mtime = first.stat().st_mtime_ns
    build(first)  # unchanged sources: the file is left as it is
    assert first.stat().st_mtime_ns == mtime


def test_the_built_file_runs_the_probe_as_python3s_script_and_as_a_command(tmp_path):
    (tmp_path / "r1").mkdir()
    usage = subprocess.run([sys.executable, HELPER, "probe", "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: dsc_node.pyz probe")
    for argv in ([sys.executable, HELPER], [HELPER]):  # the roles run it as a command (its #! line)
        r = subprocess.run([*argv, "probe", "--run-root", str(tmp_path)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert set(out) == PROBE_KEYS and [run["id"] for run in out["runs"]] == ["r1"]


def test_the_entry_shim_gives_the_script_its_own_directory_first_and_nothing_of_the_package(tmp_path):
    """Run from the built file, the shim puts the script's directory where the zip was
    (sys.path[0]); a module of the user's named like one of the package's is the user's; the
    shim loaded no more than itself (no argparse, no process control: every rank pays it)."""
    code = tmp_path / "code"
    code.mkdir()
    for name in ("cli", "rundir", "entry", "probe"):
        (code / f"{name}.py").write_text(f"WHO = 'user {name}'\n")
    (code / "train.py").write_text(
        "import json, sys\n"
        "import cli, entry, probe, rundir\n"
        "print(json.dumps({'path': sys.path, 'who': [m.WHO for m in (cli, entry, probe, rundir)],\n"
        "                  'package': sorted(m for m in sys.modules if m.startswith('dscnode')),\n"
        "                  'heavy': sorted(m for m in ('argparse', 'tarfile', 'subprocess') if m in sys.modules)}))\n")
    r = subprocess.run([sys.executable, "-S", HELPER, "--local_rank=0", "entry", "--script", str(code / "train.py")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["path"][0] == str(code) and not any(p.endswith(".pyz") for p in out["path"])
    assert out["who"] == ["user cli", "user entry", "user probe", "user rundir"]
    assert out["package"] == ["dscnode", "dscnode.cli", "dscnode.complete", "dscnode.entry", "dscnode.nccllog",
                              "dscnode.ranktimes", "dscnode.rundir"]
    assert out["heavy"] == []


def test_no_module_of_the_package_exceeds_600_lines():
    long = {p.name: n for p in PACKAGE.glob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"{long}: split by concern (node/dscnode/__init__.py lists the modules)"


def test_no_module_of_the_package_imports_another_in_a_circle():
    """The modules' imports of each other (cli's own, made when an action runs, included) form no
    cycle: rundir under everything, the entry shim on rundir, ranktimes, nccllog and complete alone
    (what every rank loads), each of those on rundir at most."""
    imports = {}
    for path in PACKAGE.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dscnode."):
                found.add(node.module.split(".")[1])
            elif isinstance(node, ast.ImportFrom) and node.module == "dscnode":
                found.update(a.name for a in node.names if (PACKAGE / f"{a.name}.py").exists())
        imports[path.stem] = found - {path.stem}
    assert imports["entry"] == {"rundir", "ranktimes", "nccllog", "complete"} and imports["rundir"] == set()
    assert all(imports[m] <= {"rundir"} for m in ("ranktimes", "nccllog", "complete"))
    list(graphlib.TopologicalSorter(imports).static_order())  # CycleError names a circle
