"""Every variable a role reads is declared in its meta/argument_specs.yml (any entry point),
defined by the role itself, or one of INPUTS (the plan, Ansible's own variables, the public facts
another role sets, each below with why); and a private variable (__<role>, __<role>_...) is
named only inside its own role.

What a role reads: every Jinja expression in its tasks, handlers, vars, defaults and templates
(strings holding {{ }} or {% %}, and the bare expressions of when, until, changed_when,
failed_when and assert's that), its undeclared names as Jinja finds them. What it defines: its
defaults and vars, register names, set_fact keys, vars: of a task, block or include, loop_var.

    .venv/bin/pytest tests/unit/test_role_specs.py -q
"""
import re
import warnings
from pathlib import Path

import jinja2
import jinja2.meta
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if (p / "tasks").is_dir())
READ_DIRS = ("tasks", "handlers", "vars", "defaults", "templates")

# Ansible's own variables the roles read: set by Ansible for every host and task, never a setting.
MAGIC = {
    "inventory_hostname": "the host a task runs for",
    "hostvars": "every host's variables (the roles read other nodes' results and facts through it)",
    "groups": "the inventory's groups",
    "ansible_facts": "the facts Ansible gathered (provision.yml gathers them)",
    "ansible_check_mode": "whether the playbook runs with --check",
    "omit": "leaves a module argument out",
    "play_hosts": "the play's hosts still running",
    "ansible_play_hosts": "the play's hosts still running",
    "ansible_play_hosts_all": "every host of the play",
    "playbook_dir": "the playbook's directory (playbooks/): the repository's files are found from it",
    "role_path": "the role's own directory",
    "ansible_playbook_python": "the control node's Python that runs Ansible (the plot is drawn with it)",
    "ansible_connection": "how Ansible reaches the node (local on the one-node default)",
    "item": "the current loop item",
    "ansible_failed_result": "the failed task's result, in a block's rescue",
}
# Public facts (dsc_...) a role sets that other roles read: {name: (the role that sets it, what
# it is)}. The toolkit's other facts (dscplan.TOOLKIT_VARIABLES) are read by their own role or a
# playbook only.
PUBLIC_FACTS = {
    "dsc_plan": ("plan", "the plan every later play applies (registered by the dsc_plan action)"),
}
INPUTS = set(MAGIC) | set(PUBLIC_FACTS)

# Expressions Ansible evaluates without {{ }}.
BARE = ("when", "until", "changed_when", "failed_when", "that")
SET_FACT = ("set_fact", "ansible.builtin.set_fact")
# A file that is a role's own code: the role hands it hostvars, and it reads that role's facts.
ROLE_CODE = {"plugins/filter/preflight.py": "preflight"}
PRIVATE = re.compile(r"\b__[a-z][a-z0-9_]*\b")


class AnyName(dict):
    """Every filter and test name resolves: parsing needs none of Ansible's plugins."""

    def get(self, key, default=None):
        return super().get(key, len)

    def __contains__(self, key):
        return True


def environment():
    env = jinja2.Environment(extensions=["jinja2.ext.do", "jinja2.ext.loopcontrols"])
    env.filters, env.tests = AnyName(env.filters), AnyName(env.tests)
    # Ansible's Jinja globals: functions, not variables.
    env.globals.update(dict.fromkeys(("lookup", "query", "q", "now", "undef"), len))
    return env


ENV = environment()


def names_read(template, where):
    """The undeclared names of one Jinja template (its own {% set %} and loop names apart)."""
    try:
        with warnings.catch_warnings():  # a regex's '\s' in a Jinja string: Ansible reads it the same way
            warnings.simplefilter("ignore", DeprecationWarning)
            ast = ENV.parse(template)
    except jinja2.TemplateSyntaxError as e:
        pytest.fail(f"{where}: {e}: {template!r}")
    return jinja2.meta.find_undeclared_variables(ast) - set(ENV.globals)


class Reads:
    """What some YAML reads ({name: [file, ...]}) and defines (a set of names)."""

    def __init__(self):
        self.reads, self.defined = {}, set()

    def read(self, template, where):
        for name in names_read(template, where):
            self.reads.setdefault(name, []).append(where)

    def bare(self, value, where):
        """when/until/that values: expressions, one or a list (a bool needs no reading)."""
        for expr in value if isinstance(value, list) else [value]:
            if isinstance(expr, str):
                self.read(expr if "{{" in expr or "{%" in expr else "{{ " + expr + " }}", where)

    def walk(self, data, where):
        if isinstance(data, list):
            for x in data:
                self.walk(x, where)
        elif isinstance(data, str):
            if "{{" in data or "{%" in data:
                self.read(data, where)
        elif isinstance(data, dict):
            self.walk_dict(data, where)

    def walk_dict(self, data, where):
        for key, value in data.items():
            if key in BARE:
                self.bare(value, where)
                continue
            if key == "register":
                self.defined.add(value)
            elif key in ("vars",) + SET_FACT and isinstance(value, dict):  # task, block, include vars
                self.defined.update(k for k in value if k != "cacheable")
            elif key == "loop_control":
                self.defined.update(value[k] for k in ("loop_var", "index_var") if k in value)
            self.walk(value, where)


def role_reads(role):
    """What roles/<role> reads and defines: its tasks, handlers, vars, defaults and templates."""
    r = Reads()
    for sub in READ_DIRS:
        for path in sorted(p for p in (ROOT / "roles" / role / sub).rglob("*") if p.is_file()):
            where = str(path.relative_to(ROOT))
            if sub == "templates":
                r.read(path.read_text(), where)
                continue
            data = yaml.safe_load(path.read_text())
            if sub in ("vars", "defaults"):
                r.defined.update(data or {})
            r.walk(data, where)
    return r


def spec_options(role):
    """Every option of every entry point of the role's argument spec."""
    specs = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
    return {name for entry in specs["argument_specs"].values() for name in entry.get("options") or {}}


@pytest.mark.parametrize("role", ROLES)
def test_every_variable_a_role_reads_is_declared(role):
    r = role_reads(role)
    missing = sorted(f"{name} (read in {', '.join(sorted(set(at)))})" for name, at in r.reads.items()
                     if name not in spec_options(role) | r.defined | INPUTS)
    assert not missing, (f"roles/{role} reads variables it neither declares, defines nor takes from INPUTS:\n"
                         + "\n".join(missing) + f"\nFix: declare each in roles/{role}/meta/argument_specs.yml "
                         "with a description of what it is, then regenerate docs/configuration.md.")


@pytest.mark.parametrize("fact", sorted(PUBLIC_FACTS))
def test_each_public_fact_is_set_by_the_role_named_and_read_by_another(fact):
    role = PUBLIC_FACTS[fact][0]
    assert fact in role_reads(role).defined, f"{fact}: roles/{role} does not register or set it"
    assert any(fact in role_reads(other).reads for other in ROLES if other != role), f"{fact}: no other role reads it"


def role_entries(data):
    """(role, tasks file) of every include_role/import_role and roles: entry in some YAML."""
    if isinstance(data, list):
        return [e for x in data for e in role_entries(x)]
    if not isinstance(data, dict):
        return []
    found = []
    for key, value in data.items():
        if key.split(".")[-1] in ("include_role", "import_role"):
            found.append((value["name"], value.get("tasks_from", "main").removesuffix(".yml")))
        elif key == "roles":
            found += [(r if isinstance(r, str) else r["role"], "main") for r in value]
        else:
            found += role_entries(value)
    return found


def test_each_entry_point_the_playbooks_use_has_a_spec_and_a_tasks_file():
    used = {e for path in sorted((ROOT / "playbooks").glob("*.yml")) + sorted((ROOT / "roles").rglob("tasks/*.yml"))
            for e in role_entries(yaml.safe_load(path.read_text()))}
    assert ("runs", "plot") in used and ("plan", "main") in used
    for role, entry in sorted(used):
        specs = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
        assert entry in specs["argument_specs"], f"roles/{role}: no argument spec for the entry point {entry}"
    for role in ROLES:
        specs = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
        for entry in specs["argument_specs"]:
            assert (ROOT / "roles" / role / "tasks" / f"{entry}.yml").is_file(), f"roles/{role}: {entry} has no tasks file"


def owner(name):
    """The role a private variable belongs to (__<role> or __<role>_...), or None."""
    return next((role for role in ROLES if name == f"__{role}" or name.startswith(f"__{role}_")), None)


def private_names(path):
    return {n for n in PRIVATE.findall(path.read_text()) if not n.endswith("__")}  # not Python's __x__


def outside_files():
    """Everything outside the roles that may name a variable: playbooks and plugins."""
    return (sorted((ROOT / "playbooks").glob("*.yml")) + sorted(ROOT.glob("*.yml"))
            + sorted((ROOT / "plugins").rglob("*.py")) + sorted(p for p in (ROOT / "templates").rglob("*") if p.is_file()))


def test_private_variables_stay_in_their_role():
    wrong = []
    for role in ROLES:
        for path in sorted((ROOT / "roles" / role).rglob("*.yml")):
            wrong += [f"{path.relative_to(ROOT)}: {n} (not __{role}_...)"
                      for n in sorted(private_names(path)) if owner(n) != role]
    for path in outside_files():
        rel = path.relative_to(ROOT).as_posix()
        wrong += [f"{rel}: {n} (private to roles/{owner(n)})" for n in sorted(private_names(path))
                  if owner(n) and ROLE_CODE.get(rel) != owner(n)]
    assert not wrong, ("private variables named outside their own role:\n" + "\n".join(wrong)
                       + "\nFix: rename a role's own to __<role>_..., and hand what another role or "
                       "playbook needs over as a declared input or a public fact.")


def test_the_private_name_check_sees_a_crossing():
    assert owner("__plan_probe") == "plan" and owner("__preflight_reach") == "preflight"
    assert owner("__report_diff") is None and owner("__base_packages") == "base_packages"


def test_the_reading_finds_names_in_templates_and_bare_expressions():
    r = Reads()
    r.walk([{"name": "x {{ a | to_json }}", "ansible.builtin.command": {"argv": ["{{ b[c] }}"]},
             "register": "out", "when": "d is defined and out.rc == 0", "changed_when": False,
             "vars": {"e": "{% for i in f %}{{ i }}{% endfor %}"}, "loop_control": {"loop_var": "h"},
             "ansible.builtin.assert": {"that": ["g | length > 0"]}}], "t.yml")
    assert set(r.reads) == {"a", "b", "c", "d", "out", "f", "g"} and r.defined == {"out", "e", "h"}
