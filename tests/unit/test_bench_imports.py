"""The GPU benchmarks run without the control venv (the GPU image's python, the carried
ansible-core): bench/gpu_ansible.sh puts the project's own packages on PYTHONPATH for
ansible-playbook and for bench's scripts, the paths the venv's .pth names (scripts/import-paths.sh).
Here every bench script starts, and the plan's and filters' imports resolve, with those paths
alone: python -S reads no .pth, and the venv's site-packages stands in for the image's own
(jinja2, yaml, packaging).

    .venv/bin/pytest tests/unit/test_bench_imports.py -q
"""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench_path():
    r = subprocess.run(["bash", "-c", '. bench/gpu_ansible.sh && printf %s "$repo_path"'], cwd=ROOT,
                       capture_output=True, text=True, check=True)
    return r.stdout


def run_without_pth(*args):
    env = dict(os.environ, PYTHONPATH=f"{bench_path()}:{sysconfig.get_path('purelib')}")
    return subprocess.run([sys.executable, "-S", *args], cwd="/", env=env, capture_output=True, text=True, timeout=120)


def test_the_bench_path_is_the_control_venvs():
    pth = Path(sysconfig.get_path("purelib"), "dscluster.pth").read_text().split()
    assert bench_path().split(":") == pth


def test_ansible_playbooks_imports_resolve_on_the_bench_path():
    r = run_without_pth("-c", "import dscplan, dscnode.records; "
                              "import plugins.filter.preflight, plugins.filter.cluster, plugins.filter.doctor")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "bench").glob("*.py")))
def test_every_bench_script_starts_on_the_bench_path(script):
    r = run_without_pth(str(ROOT / "bench" / script), "--help")
    assert r.returncode == 0, r.stderr[-2000:]
