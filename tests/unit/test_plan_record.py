"""The plan as make_plan gives it (plugins/module_utils/dscplan: __init__, record, problems): the
record handed to Ansible against every dsc_plan key that roles/, playbooks/ and templates/ read,
the model a valid cluster gives, and its problems, each once and all at once.

    .venv/bin/pytest tests/unit/test_plan_record.py -q
"""
import dataclasses
import re

import dscplan
from tests.unit.plan_helpers import ROOT, DEFAULTS, PATHS, plan


# Where the plan is read: the roles, the playbooks and the templates (dsc_plan.<key>, dsc_plan['key']).
PLAN_READERS = sorted([p for d in ("roles", "playbooks", "templates") for p in (ROOT / d).rglob("*") if p.is_file()]
                      + list(ROOT.glob("*.yml")))


PLAN_KEY = re.compile(r"\bdsc_plan(?:\.([A-Za-z_]\w*)|\[\s*['\"]([^'\"]+)['\"]\s*\])")


def plan_reads():
    """{key: ["file:line", ...]} of every dsc_plan key read in PLAN_READERS."""
    reads = {}
    for path in PLAN_READERS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in PLAN_KEY.finditer(line):
                reads.setdefault(m.group(1) or m.group(2), []).append(f"{path.relative_to(ROOT)}:{n}")
    return reads


PLAN_FIELDS = {f.name for f in dataclasses.fields(dscplan.CompanionPlan)}


def test_every_plan_key_the_roles_read_is_a_field_of_the_plan():
    unknown = [f"{where}: dsc_plan.{key}" for key, at in plan_reads().items() if key not in PLAN_FIELDS for where in at]
    assert unknown == [], "not a field of dscplan.Plan or CompanionPlan:\n" + "\n".join(unknown)


def test_every_plan_field_is_read_unless_by_design():
    unread = sorted(PLAN_FIELDS - set(plan_reads()) - set(dscplan.PLAN_FIELDS_NOT_READ_BY_ROLES))
    assert unread == [], f"plan fields nothing in roles/, playbooks/ or templates/ reads: {unread}"
    assert set(dscplan.PLAN_FIELDS_NOT_READ_BY_ROLES) <= PLAN_FIELDS


def test_the_plan_handed_to_ansible_has_the_records_fields_exactly():
    launch, _ = plan(options={}, full_run=True)
    status, _ = plan()
    assert set(launch) == {f.name for f in dataclasses.fields(dscplan.Plan)}
    assert set(status) == PLAN_FIELDS and status["run"] is None and launch["run"]["id"]


def test_a_valid_cluster_gives_the_model():
    p, errors = plan()
    assert errors == []
    assert p["master"] == "node1" and p["master_addr"] == "10.0.0.11"
    assert p["world_size"] == 4 and p["num_nodes"] == 2 and p["accelerator"] == "cpu"
    assert p["node"]["node2"]["iface"] == "eth0" and p["node"]["node2"]["rank"] == 1
    assert p["python"] == "/opt/dscluster/env/bin/python" and p["run_root"] == "/opt/dscluster/runs"
    assert p["rank_env"]["NCCL_SOCKET_IFNAME"] == "eth0" and p["rank_env"]["DS_ACCELERATOR"] == "cpu"


def test_a_cluster_wide_error_is_reported_once_not_per_node():
    p, errors = plan(n=4, dsc_master_port=80)
    assert len([e for e in errors if e.startswith("dsc_master_port")]) == 1


def test_empty_cluster_group_says_so():
    p, errors = dscplan.make_plan({}, {"cluster": []}, {}, DEFAULTS, PATHS)
    assert p is None and "the group 'cluster' is empty or missing" in errors[0]


def test_every_problem_comes_at_once_cluster_and_run():
    p, errors = plan(options={"preset": "zero9", "run_id": "a/b", "dsc_entry_args": ["$(id)"]},
                     full_run=True, dsc_slots=0)
    text = "\n".join(errors)
    for needle in ("dsc_slots on host node1 is 0", "preset is 'zero9'", "run_id is 'a/b'",
                   "dsc_entry_args holds '$(id)'"):
        assert needle in text
