"""The playbooks and roles meet ansible-lint's production profile (.ansible-lint says what is skipped and why);
the Python meets ruff.toml's rules (ruff from the control venv, pinned in requirements/control.txt)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Where the project's Python lives; tests/fixtures/scripts holds vendored scripts, excluded in ruff.toml.
PYTHON_TREES = ("plugins", "node", "train", "scripts", "molecule", "tests", "bench", "conftest.py")


def test_ansible_lint_production_profile():
    r = subprocess.run([str(Path(sys.executable).parent / "ansible-lint"), "--nocolor"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    # A warning passes ansible-lint's exit code; the production profile is met only without any.
    assert "0 failure(s), 0 warning(s)" in r.stdout + r.stderr, (r.stdout + r.stderr)[-4000:]


def test_ruff_finds_nothing_in_the_projects_python():
    """Every finding fails, each printed; so does a warning (a setting ruff ignores) and a missing
    ruff (scripts/setup-control.sh installs it). The files ruff reads must cover every Python
    tree of the project and none of the vendored scripts."""
    ruff = Path(sys.executable).parent / "ruff"
    assert ruff.is_file(), f"no {ruff}: ruff is pinned in requirements/control.txt (scripts/setup-control.sh)"
    r = subprocess.run([str(ruff), "check", "--no-cache", "--output-format", "concise"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "warning" not in r.stderr.lower(), (r.stdout + r.stderr)[-8000:]
    listed = subprocess.run([str(ruff), "check", "--no-cache", "--show-files"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, check=True).stdout
    files = {Path(line.strip()).relative_to(ROOT).as_posix() for line in listed.splitlines()
             if line.strip().endswith(".py")}
    assert all(any(f == tree or f.startswith(tree + "/") for f in files) for tree in PYTHON_TREES), sorted(files)
    assert not [f for f in files if f.startswith("tests/fixtures/scripts/")]
