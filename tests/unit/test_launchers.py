"""The launch modes, one module each (plugins/module_utils/dscplan/launchers), chosen once by the
plan: what each gives the roles (its record), the commands and supervisor options of each, and
that nothing else in the toolkit names a mode or branches on it.

    .venv/bin/pytest tests/unit/test_launchers.py -q
"""
import re

import pytest

import dscplan
from dscplan.launchers import LAUNCHERS
from tests.unit.plan_helpers import DEFAULTS, ROOT, plan

# Where a launch mode may be named: its own module, the settings' vocabulary and the setting's spec.
MODE_HOMES = ("plugins/module_utils/dscplan/launchers/", "plugins/module_utils/dscplan/vocabulary.py",
              "roles/plan/meta/argument_specs.yml")
# The setting, or a mode's name compared or given as a value.
MODE_MENTION = re.compile(r"launch_mode|(==|!=)\s*['\"](pdsh|no_ssh|slurm)['\"]|['\"](pdsh|no_ssh|slurm)['\"]\s*(==|!=|in\b)"
                          r"|['\"]no_ssh['\"]")
CODE = [p for d in ("roles", "playbooks", "templates", "plugins", "node") for p in (ROOT / d).rglob("*")
        if p.is_file() and p.suffix in (".yml", ".py", ".j2", ".json", ".sh")] + list(ROOT.glob("*.yml"))


def test_no_launch_mode_is_named_outside_its_module():
    """The roles, playbooks, templates, filters and the node helper run what the plan's launcher
    gives: a mention of the setting, or a mode compared by name, anywhere else fails here."""
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in CODE
             if not str(p.relative_to(ROOT)).startswith(MODE_HOMES)
             for n, line in enumerate(p.read_text().splitlines(), 1) if MODE_MENTION.search(line)]
    assert found == [], "a launch mode named outside dscplan/launchers:\n" + "\n".join(found)
    assert len(CODE) > 100  # the scan sees the tree


@pytest.mark.parametrize("mode,start,peers,logs,mesh,queued", [
    ("pdsh", ["node1"], ["node1", "node2", "node3"], ["node1"], True, False),
    ("no_ssh", ["node1", "node2", "node3"], [], ["node1", "node2", "node3"], False, False),
    ("slurm", [], [], ["node1", "node2", "node3"], False, True),
])
def test_each_mode_gives_the_roles_where_runs_start_and_are_read(mode, start, peers, logs, mesh, queued):
    p, errors = plan(n=3, options={"run_id": "r1"}, full_run=True, dsc_launch_mode=mode)
    assert errors == [], errors
    rec = p["launcher"]
    assert (rec["name"], rec["start_nodes"], rec["peers"], rec["log_nodes"], rec["ssh_mesh"]) == (mode, start, peers, logs, mesh)
    assert (rec["queue"] is not None) == queued
    commands = p["run"]["commands"]
    assert sorted(commands) == (["node1"] if mode == "pdsh" else ["node1", "node2", "node3"])
    for node, argv in commands.items():
        assert argv[0].endswith("/deepspeed") and "entry" in argv
        own = ["--no_ssh", "--node_rank", str(int(node[-1]) - 1)]
        assert any(argv[i:i + 3] == own for i in range(len(argv))) == (mode != "pdsh")
        args = p["run"]["start_args"][node]
        assert args[args.index("--hosts") + 1] == ("node1,node2,node3" if mode == "pdsh" else node)
    batch = p["run"]["files"].get("slurm.sbatch", "")
    assert ("#SBATCH --job-name=dsc-r1" in batch) == queued
    assert set(p["run"]["resume_files"]) == ({"slurm.sbatch", "slurm_task.sh"} if queued else set())


def test_restarts_are_the_supervisors_only_where_it_restarts_every_node():
    for mode, want in (("pdsh", "2"), ("slurm", "0")):
        p, errors = plan(n=2, options={"max_restarts": 2}, full_run=True, dsc_launch_mode=mode)
        args = p["run"]["start_args"]["node1"]
        assert errors == [] and args[args.index("--max-restarts") + 1] == want
        if mode == "slurm":
            assert "  [ \"$attempt\" -lt 2 ] || exit 1" in p["run"]["files"]["slurm.sbatch"]
    p, errors = plan(n=2, options={"max_restarts": 2}, full_run=True, dsc_launch_mode="no_ssh")
    assert p is None and any(e.startswith("max_restarts is 2 with dsc_launch_mode no_ssh") for e in errors)


def test_an_unknown_mode_is_refused_with_the_others():
    p, errors = plan(n=2, dsc_launch_mode="mpi", dsc_slots=0)
    assert p is None and "dsc_launch_mode on host node1 is 'mpi'. Fix: one of pdsh, no_ssh, slurm." in errors
    assert any(e.startswith("dsc_slots on host node1 is 0") for e in errors)
    assert list(LAUNCHERS) == ["pdsh", "no_ssh", "slurm"]


def test_the_probe_reads_what_the_mode_needs_with_the_specs_defaults():
    assert dscplan.probe_arguments({}, DEFAULTS) == [
        "probe", "--run-root", "/opt/dscluster/runs", "--install-root", "/opt/dscluster", "--train-user", "dstrain"]
    argv = dscplan.probe_arguments({"dsc_launch_mode": "slurm", "dsc_install_root": "/srv/d", "dsc_env_manager": "existing",
                                    "dsc_existing_python": "/opt/t/bin/python", "dsc_data_dir": "/data x"}, DEFAULTS)
    assert argv == ["probe", "--run-root", "/srv/d/runs", "--install-root", "/srv/d", "--train-user", "dstrain",
                    "--slurm", "--data-dir", "/data x", "--existing-python", "/opt/t/bin/python"]
