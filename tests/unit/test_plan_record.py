"""The plan as make_plan gives it (plugins/module_utils/dscplan: __init__, record, problems): the
record handed to Ansible against every dsc_plan key that roles/, playbooks/ and templates/ read,
the model a valid cluster gives, and its problems, each once and all at once.

    .venv/bin/pytest tests/unit/test_plan_record.py -q
"""
import dataclasses
import re
import types
import typing

import dscplan
from tests.unit.plan_helpers import ROOT, DEFAULTS, PATHS, plan


# Where the plan is read: the roles, the playbooks and the templates (dsc_plan.<key>, dsc_plan['key']).
PLAN_READERS = sorted([p for d in ("roles", "playbooks", "templates") for p in (ROOT / d).rglob("*") if p.is_file()]
                      + list(ROOT.glob("*.yml")))

# A read of the plan: dsc_plan, or an alias of a part of it, then its accessors (.key, ['key'],
# [expression]) and the filters that pick a key of each item (map(attribute=...), selectattr,
# rejectattr).
ACCESSOR = r"(?:\.[A-Za-z_]\w*|\[[^\[\]]+\])"
ALIAS = re.compile(r"^\s*(__\w+):\s*\"\{\{\s*(dsc_plan" + ACCESSOR + r"*)\s*\}\}\"\s*$")
FILTER = re.compile(r"\s*\|\s*(?:map\(attribute=['\"](\w+)['\"][^)]*\)|(?:selectattr|rejectattr)\(\s*['\"](\w+)['\"][^)]*\))")
STEP = re.compile(r"\.([A-Za-z_]\w*)|\[\s*['\"]([^'\"]+)['\"]\s*\]|\[[^\[\]]+\]")


def aliases():
    """{__name: the plan path it stands for} of every `__name: "{{ dsc_plan... }}"` in PLAN_READERS
    (roles/runs' __runs_planned, roles/pytorch's __pytorch_node, ...)."""
    found = {}
    for path in PLAN_READERS:
        for line in path.read_text().splitlines():
            m = ALIAS.match(line)
            if m:
                found[m.group(1)] = m.group(2)
    return found


def unwrap(kind):
    """A field's type without `| None`."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1 else kind


def resolve(expr, start=dscplan.CompanionPlan):
    """(the type a plan path reaches, the first key on the way that its record does not declare,
    or None). `expr` starts at dsc_plan (the CompanionPlan holds every field): accessors, then
    filters of items' keys. Past a plain dict or a leaf nothing is checked (free-form data)."""
    kind, rest = start, expr[len("dsc_plan"):]
    while rest:
        m = STEP.match(rest)
        f = FILTER.match(rest)
        if m:
            key = m.group(1) or m.group(2)
            rest = rest[m.end():]
        elif f:
            key = f.group(1) or f.group(2)
            rest = rest[f.end():]
            item = typing.get_args(kind)[-1] if typing.get_origin(kind) in (list, dict) else None
            if dataclasses.is_dataclass(item):
                hints = typing.get_type_hints(item)
                if key not in hints:
                    return None, f"{item.__name__}.{key}"
                kind = list[hints[key]] if f.group(1) else kind
            continue
        else:
            break
        if dataclasses.is_dataclass(kind):
            hints = typing.get_type_hints(kind)
            if key is None:
                return None, f"{kind.__name__}[?]"
            if key not in hints:
                return None, f"{kind.__name__}.{key}"
            kind = unwrap(hints[key])
        elif typing.get_origin(kind) in (list, dict) and key is None:
            kind = unwrap(typing.get_args(kind)[-1])
        else:
            return kind, None  # a plain dict's key, a leaf's method: free-form
    return kind, None


READ = re.compile(r"\b(dsc_plan|__\w+)((?:" + ACCESSOR + r")*(?:" + FILTER.pattern + r")*)")


def plan_reads():
    """{the plan path read, resolved through aliases: ["file:line", ...]} of every read in PLAN_READERS."""
    alias, reads = aliases(), {}
    for path in PLAN_READERS:
        text = path.read_text()  # whole: a filter chain may go on on the next line
        for m in READ.finditer(text):
            base = "dsc_plan" if m.group(1) == "dsc_plan" else alias.get(m.group(1))
            if base is not None and (m.group(2) or base != "dsc_plan"):
                expr = re.sub(r"\s+", " ", base + m.group(2))
                reads.setdefault(expr, []).append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}")
    return reads


PLAN_FIELDS = {f.name for f in dataclasses.fields(dscplan.CompanionPlan)}


def test_every_plan_key_the_roles_read_is_declared_at_every_depth():
    """dsc_plan.<key>, dsc_plan.node[...].<key>, dsc_plan.run.<key> (and its alias __runs_planned),
    dsc_plan.nodes | map(attribute=<key>), dsc_plan.launcher.queue.<key>...: each key a field of its
    record (dscplan.record), down to the leaves."""
    unknown = [f"{where}: {expr} ({bad} is not declared)" for expr, at in plan_reads().items()
               for bad in [resolve(expr)[1]] if bad for where in at]
    assert unknown == [], "not a field of its record in dscplan.record:\n" + "\n".join(unknown)
    assert "dsc_plan.run.id" in plan_reads() and any(e.startswith("dsc_plan.node[") for e in plan_reads())


def test_a_misspelt_nested_key_is_caught():
    assert resolve("dsc_plan.node[inventory_hostname].gpuz")[1] == "NodeRecord.gpuz"
    assert resolve("dsc_plan.run.commands[inventory_hostname]")[1] is None
    assert resolve("dsc_plan.launcher.queue.job_prefx")[1] == "QueueRecord.job_prefx"
    assert resolve("dsc_plan.nodes | selectattr('ops_sourc', 'eq', x)")[1] == "NodeRecord.ops_sourc"
    assert resolve("dsc_plan.nodes | map(attribute='name')")[0] == list[str]
    assert resolve("dsc_plan.lock.sdists")[1] is None  # a plain dict: free-form


def test_the_hostfile_template_reads_node_records():
    text = (ROOT / "templates" / "hostfile.j2").read_text()
    keys = set(re.findall(r"\bnode\.(\w+)", text))
    assert keys and keys <= set(typing.get_type_hints(dscplan.record.NodeRecord)), keys


def test_every_plan_field_is_read_unless_by_design():
    read = {re.match(r"dsc_plan(?:\.(\w+)|\[['\"](\w+))", e).group(1) or "" for e in plan_reads()}
    unread = sorted(PLAN_FIELDS - read - set(dscplan.PLAN_FIELDS_NOT_READ_BY_ROLES))
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
