"""The plan (plugins/module_utils/dscplan): every check, the batch arithmetic, the ds_config,
the rendered files and the launcher command, with no node and no Ansible run.

    .venv/bin/pytest tests/unit -q
"""
import base64
import dataclasses
import io
import itertools
import json
import re
import tarfile
from pathlib import Path

import pytest
import yaml

from dscplan import memory as dsc_memory
from train import memory as train_memory
import dscplan
from dscnode.rundir import secrets_file

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "roles" / "plan" / "meta" / "argument_specs.yml"
OPTIONS = yaml.safe_load(SPEC.read_text())["argument_specs"]["main"]["options"]
PINS = dscplan.read_pins(ROOT / "requirements" / "pins.env")
DEFAULTS = dscplan.load_defaults(SPEC, ROOT / "requirements" / "pins.env")
PATHS = {"repo": str(ROOT), "templates": str(ROOT / "templates")}


def probe(addr, gpus=0, cap="9.0", runs=()):
    return {"gpus": [{"index": str(i), "compute_cap": cap, "driver": "580.1"} for i in range(gpus)],
            "interfaces": {"lo": ["127.0.0.1"], "eth0": [addr]}, "infiniband": False,
            "runs": list(runs)}


def cluster(n=2, slots=2, gpus=0, runs=(), **settings):
    names = [f"node{i + 1}" for i in range(n)]
    hostvars = {h: dict({"dsc_addr": f"10.0.0.{11 + i}", "dsc_slots": slots}, **settings)
                for i, h in enumerate(names)}
    probes = {h: probe(f"10.0.0.{11 + i}", gpus, runs=runs if i == 0 else ()) for i, h in enumerate(names)}
    return hostvars, {"cluster": names}, probes


def plan(n=2, options=None, full_run=False, runs=(), **settings):
    hostvars, groups, probes = cluster(n, runs=runs, **settings)
    return dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, options,
                              now="20261130-000000", full_run=full_run)


def test_spec_declares_exactly_what_the_plan_reads():
    assert set(DEFAULTS) == set(dscplan.CLUSTER_SETTINGS + dscplan.SECRET_SETTINGS + dscplan.NODE_SETTINGS
                                + dscplan.RUN_OPTIONS)


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


DECLARED = dscplan.declared_settings(str(ROOT))


def plan_given(names, extra=(), **settings):
    """A plan whose nodes have the variables `names` and were given `extra` with -e (names only,
    as the dsc_plan action hands them over)."""
    hostvars, groups, probes = cluster(2, **settings)
    variables = {h: list(hostvars[h]) + list(names) + list(extra) for h in hostvars}
    return dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, variables=variables,
                              extra_vars=set(extra))


@pytest.mark.parametrize("retired,current", sorted(dscplan.RETIRED_SETTINGS.items()))
def test_a_retired_setting_is_refused_naming_its_current_name(retired, current):
    p, errors = plan(**{retired: "WARN"})
    assert p is None and errors == [
        f"{retired} on hosts node1, node2 is the name of an earlier version: the setting is {current} now, "
        f"and {retired} would be ignored. Fix: rename it to {current}."]
    p, errors = plan_given([], extra=[retired])
    assert errors == [f"{retired} (given with -e) is the name of an earlier version: the setting is {current} "
                      f"now, and {retired} would be ignored. Fix: rename it to {current}."]


def test_an_unknown_setting_is_refused_naming_the_variable_the_host_and_the_fix():
    hostvars, groups, probes = cluster(2)
    hostvars["node2"]["dsc_micro_batchs"] = 4
    hostvars["node2"]["cluster_network_firewal"] = False
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert p is None and errors == [
        "dsc_micro_batchs on host node2 is not a setting: no role declares it (roles/*/meta/argument_specs.yml), "
        "so it would be ignored. Fix: dsc_micro_batch, if that is what you meant, or remove it.",
        "cluster_network_firewal on host node2 is not a setting: no role declares it "
        "(roles/*/meta/argument_specs.yml), so it would be ignored. Fix: cluster_network_firewall, if that is "
        "what you meant, or remove it."]
    p, errors = plan_given([], extra=["dsc_whatever"])
    assert errors == ["dsc_whatever (given with -e) is not a setting: no role declares it "
                      "(roles/*/meta/argument_specs.yml), so it would be ignored. Fix: remove it, or correct its "
                      "name (roles/plan/meta/argument_specs.yml lists the settings)."]


def test_every_declared_setting_is_accepted_and_other_prefixes_are_not_looked_at():
    names = sorted(n for n in DECLARED if n.startswith(dscplan.SETTING_PREFIXES))
    assert "dsc_secrets" in names and "dsc_conda_installer_url" in names and "cluster_network_key_dir" in names
    p, errors = plan_given(names + ["__plan_probe", "base_packages_extra", "ansible_host", "preset"],
                           extra=names)
    assert errors == [], errors


def toolkit_set_variables():
    """The variables the roles and playbooks set themselves (register:, set_fact)."""
    found = set()

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("register"), str):
                found.add(node["register"])
            for module in ("ansible.builtin.set_fact", "set_fact"):
                if isinstance(node.get(module), dict):
                    found.update(k for k in node[module] if k != "cacheable")
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    for path in sorted(ROOT.glob("roles/*/tasks/*.yml")) + sorted(ROOT.glob("playbooks/*.yml")):
        walk(yaml.safe_load(path.read_text()))
    return found


def test_what_the_toolkit_sets_itself_is_never_taken_for_a_setting():
    ours = {n for n in toolkit_set_variables() if n.startswith(dscplan.SETTING_PREFIXES)}
    assert ours == set(dscplan.TOOLKIT_VARIABLES)
    p, errors = plan_given(sorted(ours))
    assert errors == [], errors


# What users copy (inventory/) and what the benchmarks run with (bench/inventory/).
SHIPPED_INVENTORIES = sorted(str(p.relative_to(ROOT)) for parent in ("inventory", "bench/inventory")
                             for p in (ROOT / parent).iterdir() if p.is_dir())


@pytest.mark.parametrize("inventory", SHIPPED_INVENTORIES)
def test_the_shipped_inventories_set_only_declared_settings(inventory):
    def keys(node):
        if isinstance(node, dict):
            for k, v in node.items():
                yield k
                yield from keys(v)
    names = {k for path in (ROOT / inventory).rglob("*.yml")
             for k in keys(yaml.safe_load(path.read_text())) if str(k).startswith(dscplan.SETTING_PREFIXES)}
    assert names and names <= DECLARED, sorted(names - DECLARED)


@pytest.mark.parametrize("name,value", [
    ("dsc_env_manager", "pip"), ("dsc_launch_mode", "mpi"), ("dsc_torch_variant", "cu999"),
    ("cluster_network_firewall_backend", "iptables;id"), ("dsc_nccl_debug", "ALL"),
])
def test_a_setting_outside_its_choices_is_refused_by_the_argument_spec(name, value):
    """The plan role's argument validation (Ansible's own validator over the spec, before the
    plan runs) refuses it, naming the setting, the choices and the value."""
    from ansible.module_utils.common.arg_spec import ArgumentSpecValidator  # noqa: PLC0415 - see ansible_templates
    errors = ArgumentSpecValidator(OPTIONS).validate({name: value}).error_messages
    assert errors == [f"value of {name} must be one of: {', '.join(OPTIONS[name]['choices'])}, got: {value}"]


def test_the_torch_variants_are_the_spec_choices():
    assert OPTIONS["dsc_torch_variant"]["choices"] == list(dscplan.TORCH_INDEXES)


def test_versions_default_to_the_pins():
    p, _ = plan()
    assert (p["torch_version"], p["deepspeed_version"]) == (PINS["TORCH_VERSION"], PINS["DEEPSPEED_VERSION"])


def test_a_valid_cluster_gives_the_model():
    p, errors = plan()
    assert errors == []
    assert p["master"] == "node1" and p["master_addr"] == "10.0.0.11"
    assert p["world_size"] == 4 and p["num_nodes"] == 2 and p["accelerator"] == "cpu"
    assert p["node"]["node2"]["iface"] == "eth0" and p["node"]["node2"]["rank"] == 1
    assert p["python"] == "/opt/dscluster/env/bin/python" and p["run_root"] == "/opt/dscluster/runs"
    assert p["rank_env"]["NCCL_SOCKET_IFNAME"] == "eth0" and p["rank_env"]["DS_ACCELERATOR"] == "cpu"


def test_master_group_moves_a_node_to_rank_zero():
    hostvars, groups, probes = cluster(3)
    groups["master"] = ["node3"]
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert errors == [] and p["node_names"] == ["node3", "node1", "node2"]


def test_gpus_give_cuda_bf16_and_the_arch_list():
    hostvars, groups, probes = cluster(2, slots="auto")
    for h in probes:
        probes[h] = probe(hostvars[h]["dsc_addr"], gpus=4, cap="9.0")
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, full_run=True)
    assert errors == []
    assert p["world_size"] == 8 and p["accelerator"] == "cuda" and p["cuda_arch_list"] == "9.0"
    assert p["node_env"]["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert p["run"]["ds_config"]["bf16"] == {"enabled": True}


@pytest.mark.parametrize("caps,expect", [(["7.0"], "fp16"), (["8.0", "9.0"], "bf16"), ([], "fp32")])
def test_precision_follows_the_oldest_gpu(caps, expect):
    cfg = dscplan.precision("cuda" if caps else "cpu", caps)
    on = [k for k in ("bf16", "fp16") if cfg[k]["enabled"]]
    assert on == ([] if expect == "fp32" else [expect])


BAD = [
    ({"dsc_slots": 0}, "dsc_slots on host node1 is 0"),
    ({"dsc_slots": "many"}, "dsc_slots on host node1 is 'many'"),
    ({"dsc_slots": "auto"}, "dsc_slots on host node1 is 'auto' but nvidia-smi found no GPU there"),
    ({"dsc_install_root": "opt/dscluster"}, "dsc_install_root on host node1 is 'opt/dscluster', not an absolute path"),
    ({"dsc_install_root": "/opt/a;id"}, "dsc_install_root on host node1 is '/opt/a;id'"),
    ({"dsc_run_root": "/opt/../etc"}, "dsc_run_root on host node1 is '/opt/../etc'"),
    ({"dsc_run_root": "runs"}, "dsc_run_root on host node1 is 'runs', not an absolute path"),
    ({"dsc_torch_variant": "cu999"}, "dsc_torch_variant on host node1 is 'cu999'"),
    ({"dsc_wheelhouse": "/nonexistent/wheels"}, "dsc_wheelhouse on host node1 is '/nonexistent/wheels', which does not exist"),
    ({"dsc_env_manager": "conda"}, "dsc_conda_installer_sha256 on host node1 is empty"),
    ({"dsc_env_manager": "conda", "dsc_conda_installer_file": "/srv/Miniconda3.sh"},
     "dsc_conda_installer_sha256 on host node1 is empty"),
    ({"dsc_env_manager": "conda", "dsc_conda_installer_sha256": "abc"},
     "dsc_conda_installer_sha256 on host node1 is 'abc'"),
    ({"dsc_env_manager": "existing"}, "dsc_existing_python on host node1 is ''"),
    ({"dsc_master_port": 80}, "dsc_master_port on host node1 is 80"),
    ({"dsc_master_port": 29510, "dsc_master_port_last": 29500}, "dsc_master_port_last on host node1 is 29500"),
    ({"dsc_ssh_port": 70000}, "dsc_ssh_port on host node1 is 70000"),
    ({"dsc_train_user": "root"}, "dsc_train_user on host node1 is 'root'"),
    ({"dsc_train_user": "Bad User"}, "dsc_train_user on host node1 is 'Bad User'"),
    ({"dsc_torch_version": ">=2.0"}, "dsc_torch_version on host node1 is '>=2.0', not an exact version"),
    ({"dsc_deepspeed_version": "latest"}, "dsc_deepspeed_version on host node1 is 'latest', not an exact version"),
    ({"dsc_python_version": "python3"}, "dsc_python_version on host node1 is 'python3'"),
    ({"dsc_cluster_name": "lab/a"}, "dsc_cluster_name on host node1 is 'lab/a'"),
    ({"cluster_network_ssh_sources": ["bastion.example.com"]},
     "cluster_network_ssh_sources on host node1 is ['bastion.example.com']. Fix: a list of addresses"),
    ({"cluster_network_ssh_sources": ["10.0.0.1\nProxyCommand x"]}, "cluster_network_ssh_sources on host node1"),
    ({"cluster_network_ssh_sources": "any"}, "cluster_network_ssh_sources on host node1 is 'any'. Fix: a list"),
    ({"dsc_rank_env": {"NCCL_DEBUG": "WARN$(id)"}}, "the value of NCCL_DEBUG is 'WARN$(id)'"),
    ({"dsc_rank_env": {"HF_TOKEN": "abc"}}, "HF_TOKEN looks like a secret"),
    ({"dsc_rank_env": {"BAD NAME": "x"}}, "'BAD NAME' is not a plain variable name"),
    ({"dsc_addr": "10.0.0.300"}, "dsc_addr on host node1 is '10.0.0.300', not an IPv4 address"),
    ({"dsc_addr": "10.0.0.11\nProxyCommand x"}, "dsc_addr on host node1"),
    ({"dsc_rank_env": {"MLFLOW_TRACKING_URI": "https://user:pw@mlflow.lab"}}, "holds a password in a URL"),
    ({"dsc_requirements": ["transformers>=>4"]}, "dsc_requirements on host node1: 'transformers>=>4' is not a requirement"),
    ({"dsc_requirements": ["--index-url http://x"]}, "is not a requirement"),
    ({"dsc_requirements": ["pkg @ https://example.org/pkg.whl"]}, "installs from a URL"),
    ({"dsc_requirements": ["torch==2.0"]}, "torch and DeepSpeed are dsc_torch_version"),
    ({"dsc_requirements": "transformers"}, "Fix: a list of requirements"),
    ({"dsc_requirements_file": "/nonexistent/req.txt"}, "dsc_requirements_file on host node1 is '/nonexistent/req.txt'"),
    ({"dsc_data_dir": "/nonexistent/data"}, "dsc_data_dir on host node1 is '/nonexistent/data', which is not a directory"),
    ({"dsc_data_dir": "data/rel"}, "dsc_data_dir on host node1 is 'data/rel', not an absolute path"),
    ({"dsc_data_dir": "/data;id"}, "dsc_data_dir on host node1 is '/data;id'"),
    ({"dsc_secrets": {"HF TOKEN": "x"}}, "dsc_secrets on host node1: 'HF TOKEN' is not a plain variable name"),
    ({"dsc_secrets": ["HF_TOKEN"]}, "dsc_secrets on host node1 is not a mapping"),
]


@pytest.mark.parametrize("settings,needle", BAD, ids=[f"{next(iter(s))}={list(s.values())[0]!r}"[:40] for s, _ in BAD])
def test_bad_settings_are_refused_naming_variable_host_and_fix(settings, needle):
    p, errors = plan(**settings)
    assert p is None
    assert any(needle in e for e in errors), errors
    assert all("Fix:" in e for e in errors), errors


def test_a_cluster_wide_error_is_reported_once_not_per_node():
    p, errors = plan(n=4, dsc_master_port=80)
    assert len([e for e in errors if e.startswith("dsc_master_port")]) == 1


def test_a_cluster_wide_setting_that_differs_names_the_nodes():
    hostvars, groups, probes = cluster(3)
    hostvars["node3"]["dsc_install_root"] = "/srv/ds"
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert any(e.startswith("dsc_install_root differs between nodes") and "node3" in e for e in errors), errors


def test_duplicate_address_and_address_held_by_no_interface():
    hostvars, groups, probes = cluster(2)
    hostvars["node2"]["dsc_addr"] = "10.0.0.11"
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert any("dsc_addr on host node2 is 10.0.0.11, the same as on host node1" in e for e in errors)
    assert any("dsc_addr on host node2 is 10.0.0.11, which no interface there holds" in e for e in errors)


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


@pytest.mark.parametrize("run_id", ["../x", "/etc", "a b", "a;b", "$(id)", "x\ny", "{{ 7*7 }}", ".", "-rf", "a" * 65])
def test_hostile_run_ids_are_refused(run_id):
    p, errors = plan(options={"run_id": run_id}, full_run=True)
    assert p is None and any(e.startswith("run_id is") for e in errors), errors


@pytest.mark.parametrize("arg", ["a;b", "$(touch /x)", "`id`", "a b", "x\ny", "'q'", '"q"'])
def test_entry_args_with_shell_characters_are_refused(arg):
    p, errors = plan(options={"dsc_entry_args": ["--set", arg]}, full_run=True)
    assert p is None and any("dsc_entry_args holds" in e for e in errors)


@pytest.mark.parametrize("micro,accum,total,world,expect", [
    (2, 0, 0, 4, (2, 1, 8)),
    (2, 4, 0, 4, (2, 4, 32)),
    (2, 0, 32, 4, (2, 4, 32)),
    (0, 4, 32, 4, (2, 4, 32)),
    (2, 4, 32, 4, (2, 4, 32)),
])
def test_batch_arithmetic_derives_the_missing_value(micro, accum, total, world, expect):
    b = dscplan.batch(micro, accum, total, world)
    assert (b["micro_batch"], b["grad_accum"], b["train_batch"]) == expect


@pytest.mark.parametrize("micro,accum,total,world,needle", [
    (2, 4, 30, 4, "batch settings disagree: 2 x 4 x 4 = 32, not 30"),
    (3, 0, 32, 4, "dsc_train_batch 32 is not a multiple of micro-batch x world size = 12"),
    (0, 3, 32, 4, "dsc_train_batch 32 is not a multiple of grad-accum x world size = 12"),
    (0, 0, 0, 4, "no micro-batch"),
    (-1, 0, 0, 4, "cannot be negative"),
    ("x", 0, 0, 4, "whole numbers"),
])
def test_inconsistent_batch_settings_name_the_fix(micro, accum, total, world, needle):
    b = dscplan.batch(micro, accum, total, world)
    assert needle in b["error"] and "Fix" in b["error"]


def test_launch_plan_holds_the_ds_config_files_and_command():
    p, errors = plan(options={"preset": "zero3", "dsc_micro_batch": 4, "dsc_grad_accum": 2,
                              "dsc_ds_config_overrides": {"gradient_clipping": 0.5}},
                     full_run=True, dsc_ssh_port=2222)
    assert errors == []
    run = p["run"]
    assert run["id"] == "zero3-20261130-000000" and run["dir"] == "/opt/dscluster/runs/zero3-20261130-000000"
    cfg = json.loads(run["files"]["ds_config.json"])
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["gradient_clipping"] == 0.5
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == (4, 2, 32)
    assert cfg["bf16"] == {"enabled": False} and cfg["optimizer"]["type"] == "AdamW"
    assert dscplan.parse_hostfile(run["files"]["hostfile"]) == [("node1", 2), ("node2", 2)]
    env = dscplan.parse_ds_env(run["files"][".deepspeed_env"])
    assert env["DSC_RUN_ID"] == run["id"] and env["PATH"].startswith("/opt/dscluster/env/bin:")
    cmd = run["commands"]["node1"]
    assert list(run["commands"]) == ["node1"]  # pdsh: one launcher, on the master
    assert cmd[:5] == ["/opt/dscluster/env/bin/deepspeed", "--hostfile", f"{run['dir']}/hostfile",
                       "--master_addr", "10.0.0.11"]
    assert cmd[cmd.index("--ssh_port") + 1] == "2222" and "--no_ssh_check" not in cmd
    assert cmd[-6:] == ["--module", "train.run", "--deepspeed_config", f"{run['dir']}/ds_config.json",
                        "--config", f"{run['dir']}/train.json"]
    assert run["code_dest"] == f"{run['dir']}/code/train"
    # the run files the roles name, by the plan's paths (RunDir's names)
    assert (run["ds_env_file"], run["log"], run["allreduce_result"]) == (
        f"{run['dir']}/.deepspeed_env", f"{run['dir']}/launcher.log", f"{run['dir']}/allreduce.json")


def test_code_archive_holds_the_code_without_caches(tmp_path):
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "train.py").write_text("print('hi')\n")
    (tmp_path / "pkg" / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"x")
    data = base64.b64decode(dscplan.code_archive(tmp_path / "pkg"))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
    assert "./train.py" in names and not any("__pycache__" in n for n in names)


def test_a_user_script_runs_from_the_code_dir_itself(tmp_path):
    (tmp_path / "train.py").write_text("")
    p, errors = plan(options={"dsc_code_dir": str(tmp_path), "dsc_entry_script": "train.py",
                              "dsc_entry_args": ["--epochs", "1"]}, full_run=True)
    assert errors == []
    cmd = p["run"]["commands"]["node1"]
    assert p["run"]["code_dest"] == f"{p['run']['dir']}/code"
    assert cmd[cmd.index("train.py"):] == ["train.py", "--deepspeed_config",
                                           f"{p['run']['dir']}/ds_config.json", "--epochs", "1"]


def test_entry_script_outside_the_code_dir_is_refused(tmp_path):
    p, errors = plan(options={"dsc_code_dir": str(tmp_path), "dsc_entry_script": "../x.py"}, full_run=True)
    assert any("dsc_entry_script is '../x.py'" in e for e in errors)
    p, errors = plan(options={"dsc_code_dir": str(tmp_path), "dsc_entry_script": "missing.py"}, full_run=True)
    assert any("which is not in dsc_code_dir" in e for e in errors)


def firewalled(os_ids=("debian",), ufw=False, firewalld=False, firewall=True, **settings):
    """A plan made for provision.yml (firewall=True) on nodes whose probe saw this firewall state."""
    hostvars, groups, probes = cluster(**settings)
    for p in probes.values():
        p["firewalls"] = {"os": list(os_ids), "ufw": ufw, "firewalld": firewalld}
    return dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, firewall=firewall)


def test_firewall_settings_reach_the_plan_checked():
    p, errors = firewalled(cluster_network_ssh_sources=["any", "192.0.2.0/24", "2001:db8::1"],
                           cluster_network_firewall_backend="firewalld", firewalld=True)
    assert not errors
    assert p["ssh_sources"] == ["any", "192.0.2.0/24", "2001:db8::1"] and p["firewall"] is True
    assert {n["firewall_backend"] for n in p["nodes"]} == {"firewalld"}
    p, errors = plan()
    assert p["ssh_sources"] == [] and p["firewall"] is True


@pytest.mark.parametrize("os_ids,backend", [(["debian"], "ufw"), (["ubuntu", "debian"], "ufw"),
                                            (["rocky", "rhel", "centos", "fedora"], "firewalld"),
                                            (["fedora"], "firewalld")])
def test_firewall_auto_follows_the_os(os_ids, backend):
    p, errors = firewalled(os_ids, ufw=backend == "ufw", firewalld=backend == "firewalld")
    assert not errors and {n["firewall_backend"] for n in p["nodes"]} == {backend}


@pytest.mark.parametrize("kw,message", [
    ({"firewalld": True}, "cluster_network_firewall_backend on host node1 is 'auto' (ufw on debian), and "
                          "firewalld is running there. Fix: cluster_network_firewall_backend: firewalld"),
    ({"ufw": True, "cluster_network_firewall_backend": "firewalld"},
     "cluster_network_firewall_backend on host node2 is 'firewalld', and ufw is running there. Fix: "
     "cluster_network_firewall_backend: ufw (the site's firewall), or stop ufw, or "
     "cluster_network_firewall: false"),
    ({"os_ids": ["arch"]}, "cluster_network_firewall_backend on host node1 is 'auto', and auto knows no "
                           "firewall for its OS (arch). Fix: ufw or firewalld"),
])
def test_provision_refuses_a_firewall_it_would_not_manage_alone(kw, message):
    p, errors = firewalled(**kw)
    assert p is None and any(e.startswith(message) for e in errors), errors
    # the other playbooks, or the firewall left to the site: no refusal
    assert firewalled(firewall=False, **kw)[1] == []
    assert firewalled(cluster_network_firewall=False, **kw)[1] == []


def test_no_ssh_mode_gives_one_launcher_per_node():
    p, errors = plan(options={}, full_run=True, dsc_launch_mode="no_ssh")
    assert errors == [] and sorted(p["run"]["commands"]) == ["node1", "node2"]
    for rank, node in enumerate(["node1", "node2"]):
        cmd = p["run"]["commands"][node]
        assert "--no_ssh" in cmd and cmd[cmd.index("--node_rank") + 1] == str(rank)


def test_no_ssh_mode_refuses_restarts():
    p, errors = plan(options={"max_restarts": 2}, full_run=True, dsc_launch_mode="no_ssh")
    assert any(e.startswith("max_restarts is 2 with dsc_launch_mode no_ssh. Fix: 0") for e in errors)
    p, errors = plan(options={"max_restarts": 2}, full_run=True)
    assert errors == []


def test_one_node_skips_the_ssh_check():
    p, errors = plan(n=1, options={}, full_run=True)
    assert "--no_ssh_check" in p["run"]["commands"]["node1"]


ACTIVE = [{"id": "old", "mtime": 2, "started": True, "active": True},
          {"id": "older", "mtime": 1, "started": True, "active": False}]


def test_an_active_run_refuses_a_second_launch_unless_replace():
    p, errors = plan(options={}, full_run=True, runs=ACTIVE)
    assert any("run old is active on node1" in e and "replace=true" in e for e in errors)
    p, errors = plan(options={"replace": True}, full_run=True, runs=ACTIVE)
    assert errors == [] and p["run"]["replace"] is True


def test_a_used_run_directory_is_not_reused_and_resume_needs_a_known_run():
    p, errors = plan(options={"run_id": "older"}, full_run=True, runs=ACTIVE[1:])
    assert any("already holds a run" in e for e in errors)
    p, errors = plan(options={"run_id": "nope", "resume": True}, full_run=True, runs=ACTIVE[1:])
    assert any("no such run" in e for e in errors)
    p, errors = plan(options={"resume": True}, full_run=True, runs=ACTIVE[1:])
    assert errors == [] and p["run"]["id"] == "older" and p["run"]["commands"]["node1"][-1] == "--resume"


def test_resume_is_refused_for_a_running_run_and_for_a_finished_one_unless_forced():
    p, errors = plan(options={"run_id": "old", "resume": True}, full_run=True, runs=ACTIVE)
    assert any("run_id 'old' is still running on node1" in e and "stop.yml -e run_id=old" in e for e in errors), errors
    done = [dict(ACTIVE[1], finished=True)]
    p, errors = plan(options={"resume": True}, full_run=True, runs=done)
    assert any("run_id 'older' finished on node1" in e and "force=true" in e for e in errors), errors
    p, errors = plan(options={"resume": True, "force": True}, full_run=True, runs=done)
    assert errors == [] and p["run"]["id"] == "older"


RESUMABLE = [{"id": "r1", "mtime": 1, "started": True, "active": False,
              "launch": {"preset": "zero3", "dsc_micro_batch": 4, "dsc_entry_args": ["--epochs", "2"]}}]


def resume_with_e(options, runs=RESUMABLE):
    """resume.yml with `options` given with -e (resume itself is the playbook's)."""
    hostvars, groups, probes = cluster(2, runs=runs)
    return dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, dict(options, resume=True),
                              now="20261130-000000", full_run=True, extra_vars=set(options))


def test_resume_refuses_each_option_only_a_launch_applies_naming_it():
    values = {"preset": "zero1", "dsc_micro_batch": 8, "dsc_grad_accum": 2, "dsc_train_batch": 64,
              "dsc_ds_config_overrides": {"zero_optimization": {"stage": 1}}, "dsc_ds_config_mode": "hf",
              "dsc_ds_config_file": "/srv/ds.json", "dsc_ds_config_arg": "--deepspeed", "dsc_tensorboard": True,
              "dsc_train_config": {"steps": 100}, "dsc_model_shape": {"layers": 2}, "dsc_auto_memory_gib": 40,
              "dsc_code_shared": True, "dsc_code_dir": str(ROOT / "train")}
    assert set(values) == set(dscplan.LAUNCH_ONLY) | {"dsc_code_dir"}
    for name, value in values.items():
        p, errors = resume_with_e({name: value})
        fixed = [e for e in errors if e.startswith(f"{name} given with -e on resume")]
        assert p is None and fixed == [
            f"{name} given with -e on resume: a resume keeps the files and code run 'r1' was launched with "
            f"(ds_config.json, train.json, .deepspeed_env, memory.json, code/), so it would be ignored. Fix: "
            f"launch a new run with this option (launch.yml), or resume without it."], (name, errors)
    p, errors = resume_with_e({"dsc_micro_batch": 8, "preset": "zero1", "dsc_train_config": {"steps": 9}})
    assert errors == ["preset, dsc_micro_batch, dsc_train_config given with -e on resume: a resume keeps the files "
                      "and code run 'r1' was launched with (ds_config.json, train.json, .deepspeed_env, memory.json, "
                      "code/), so they would be ignored. Fix: launch a new run with these options (launch.yml), or "
                      "resume without them."], errors


def test_resume_takes_the_options_it_applies_and_launch_only_ones_from_the_inventory():
    p, errors = resume_with_e({"run_id": "r1", "dsc_entry_args": ["--epochs", "3"],
                               "dsc_launcher_args": ["--no_local_rank"], "dsc_resume_args": [],
                               "max_restarts": 2, "restart_backoff_s": 1, "follow": True, "preflight": False,
                               "dsc_stall_timeout_s": 60, "dsc_stall_fail": True, "force": True})
    assert errors == [] and p["run"]["max_restarts"] == 2 and p["run"]["commands"]["node1"][-2:] == ["--epochs", "3"]
    assert "--no_local_rank" in p["run"]["commands"]["node1"]
    # set in the inventory (the launches' defaults), not asked of this resume: the run's own are kept
    hostvars, groups, probes = cluster(2, runs=RESUMABLE)
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS,
                                   {"resume": True, "preset": "zero1", "dsc_micro_batch": 8,
                                    "dsc_train_config": {"steps": 5}}, full_run=True, extra_vars=set())
    assert errors == [] and p["run"]["preset"] == "zero3" and p["run"]["batch"]["micro_batch"] == 4
    # code on a shared filesystem runs from where it is: another directory applies
    shared = [dict(RESUMABLE[0], launch=dict(RESUMABLE[0]["launch"], dsc_code_shared=True, dsc_code_dir="/shared/a"))]
    p, errors = resume_with_e({"dsc_code_dir": "/shared/b"}, runs=shared)
    assert errors == [] and p["run"]["workdir"] == "/shared/b"


def test_status_reports_a_bad_run_id_with_the_cluster_problems():
    p, errors = plan(options={"run_id": "../x"}, dsc_slots=0)
    assert any(e.startswith("dsc_slots") for e in errors) and any(e.startswith("run_id is '../x'") for e in errors)


def test_status_stop_and_logs_act_on_the_active_run_else_on_none():
    p, _ = plan(options={}, runs=ACTIVE)
    assert p["run_id"] == "old" and p["run_dir"] == "/opt/dscluster/runs/old"
    p, _ = plan(options={}, runs=[dict(ACTIVE[0], active=False), ACTIVE[1]])
    assert p["run_id"] is None  # the newest directory is not taken for the run going on
    p, _ = plan(options={"run_id": "new"}, runs=[dict(ACTIVE[0], active=False), ACTIVE[1]])
    assert p["run_id"] == "new"


@pytest.mark.parametrize("text,needle", [
    ("a slots=1\n\nb slots=2\n", None),
    ("a slots = 1\n", "bad entry"),
    ("a slots=1\na slots=2\n", "multiple entries"),
    ("# only a comment\n", "empty"),
])
def test_hostfile_parsing_follows_deepspeed(text, needle):
    if needle is None:
        assert dscplan.parse_hostfile(text) == [("a", 1), ("b", 2)]
    else:
        with pytest.raises(ValueError, match=needle):
            dscplan.parse_hostfile(text)


@pytest.mark.parametrize("text,needle", [("A=1\n\nB=2\n", "no '='"), ("# c\n", "no '='"),
                                         ("export A=1\n", "not a plain variable name")])
def test_env_file_lines_that_break_deepspeed_are_refused(text, needle):
    with pytest.raises(ValueError, match=needle):
        dscplan.parse_ds_env(text)


def test_every_preset_file_merges_into_a_complete_config():
    sizes = {"micro_batch": 1, "grad_accum": 1, "train_batch": 2}
    for name in dscplan.presets(PATHS["templates"]):
        cfg = dscplan.ds_config(PATHS["templates"], name, "cpu", [], sizes, {})
        assert "zero_optimization" in cfg and cfg["train_batch_size"] == 2, name


def test_a_preset_added_as_a_file_is_offered(tmp_path):
    (tmp_path / "ds_config").mkdir()
    for f in (ROOT / "templates" / "ds_config").glob("*.json"):
        (tmp_path / "ds_config" / f.name).write_text(f.read_text())
    (tmp_path / "ds_config" / "mine.json").write_text('{"zero_optimization": {"stage": 1}}')
    assert "mine" in dscplan.presets(tmp_path)


def test_status_plans_around_an_unreachable_node():
    hostvars, groups, probes = cluster(2, slots="auto")
    probes["node1"] = probe("10.0.0.11", gpus=1)
    del probes["node2"]
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {})
    assert errors == [] and not p["node"]["node2"]["reachable"] and p["node"]["node1"]["reachable"]


def test_one_machine_under_two_names_is_refused():
    hostvars, groups, probes = cluster(2)
    for h in hostvars:
        hostvars[h]["ansible_host"] = "192.0.2.7"
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert any("ansible_host on host node2 is 192.0.2.7 (port 22), the same machine as host node1" in e
               for e in errors), errors


def test_resume_reuses_the_runs_launch_spec(tmp_path):
    (tmp_path / "train.py").write_text("")
    first, errors = plan(options={"preset": "zero3", "dsc_code_dir": str(tmp_path),
                                  "dsc_entry_script": "train.py", "dsc_entry_args": ["--epochs", "2"]},
                         full_run=True)
    spec = json.loads(first["run"]["files"]["launch.json"])
    runs = [{"id": first["run"]["id"], "mtime": 1, "started": True, "active": False, "launch": spec}]
    again, errors = plan(options={"resume": True}, full_run=True, runs=runs)
    assert errors == [] and again["run"]["preset"] == "zero3"
    cmd = again["run"]["commands"]["node1"]
    assert cmd[cmd.index("train.py"):] == ["train.py", "--deepspeed_config", f"{again['run']['dir']}/ds_config.json",
                                           "--epochs", "2", "--resume"]
    more, errors = plan(options={"resume": True, "dsc_entry_args": ["--epochs", "3"]}, full_run=True, runs=runs)
    assert more["run"]["commands"]["node1"][-3:] == ["--epochs", "3", "--resume"]  # given explicitly: wins


USER_CONFIG = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
               "fp16": {"enabled": True}, "zero_optimization": {"stage": 0}}


def user_file(tmp_path, cfg=USER_CONFIG):
    path = tmp_path / "ds_config.json"
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(path)


def test_file_mode_keeps_the_users_config(tmp_path):
    p, errors = plan(options={"dsc_ds_config_mode": "file", "dsc_ds_config_file": user_file(tmp_path)},
                     full_run=True)
    assert errors == []
    cfg = json.loads(p["run"]["files"]["ds_config.json"])
    # DeepSpeed's csv monitor is added (the user's config has none), and checkpoints are
    # node-local (run directories are per node); nothing else of the toolkit's
    assert cfg.pop("csv_monitor") == {"enabled": True, "job_name": "ds",
                                      "output_path": f"{p['run']['dir']}/monitor/"}
    assert cfg.pop("checkpoint") == {"use_node_local_storage": True}
    assert cfg == USER_CONFIG  # no preset, batch or optimizer of the toolkit's slipped in
    assert "--deepspeed_config" in p["run"]["commands"]["node1"]


def test_file_mode_merges_an_explicit_preset_and_overrides_on_top(tmp_path):
    p, errors = plan(options={"dsc_ds_config_mode": "file", "dsc_ds_config_file": user_file(tmp_path),
                              "preset": "zero2", "dsc_ds_config_overrides": {"gradient_clipping": 0.5}},
                     full_run=True)
    cfg = json.loads(p["run"]["files"]["ds_config.json"])
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["scheduler"]["type"] == "WarmupLR"
    assert cfg["gradient_clipping"] == 0.5 and cfg["optimizer"]["params"]["lr"] == 1e-3


@pytest.mark.parametrize("content,needle", [
    ("{not json", "is not JSON"),
    ("[1, 2]", "holds a list, not a JSON object"),
    (dict(USER_CONFIG, train_batch_size=16), "train_batch_size 16 is not train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x world size 4 = 32"),
])
def test_a_bad_user_config_is_refused(tmp_path, content, needle):
    p, errors = plan(options={"dsc_ds_config_mode": "file", "dsc_ds_config_file": user_file(tmp_path, content)},
                     full_run=True)
    assert p is None and any(needle in e and "Fix:" in e for e in errors), errors


def test_missing_user_config_and_unknown_mode_are_refused(tmp_path):
    p, errors = plan(options={"dsc_ds_config_mode": "file", "dsc_ds_config_file": str(tmp_path / "nope.json")},
                     full_run=True)
    assert any("dsc_ds_config_file is" in e and "No such file" in e for e in errors)
    p, errors = plan(options={"dsc_ds_config_mode": "yaml"}, full_run=True)
    assert any("dsc_ds_config_mode is 'yaml'" in e for e in errors)


def test_hf_mode_keeps_auto_values_and_passes_deepspeed(tmp_path):
    p, errors = plan(options={"dsc_ds_config_mode": "hf", "preset": "zero3"}, full_run=True)
    assert errors == []
    cfg = json.loads(p["run"]["files"]["ds_config.json"])
    assert cfg["train_batch_size"] == "auto" and cfg["bf16"] == {"enabled": "auto"}
    assert "optimizer" not in cfg and cfg["zero_optimization"]["stage"] == 3
    cmd = p["run"]["commands"]["node1"]
    assert cmd[cmd.index("--deepspeed") + 1] == f"{p['run']['dir']}/ds_config.json"
    assert "--deepspeed_config" not in cmd


def test_hf_mode_checks_numbers_the_users_file_gives(tmp_path):
    auto = dict(USER_CONFIG, train_batch_size="auto", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps="auto")
    p, errors = plan(options={"dsc_ds_config_mode": "hf", "dsc_ds_config_file": user_file(tmp_path, auto)},
                     full_run=True)
    assert errors == [] and json.loads(p["run"]["files"]["ds_config.json"])["train_batch_size"] == "auto"


def test_none_mode_passes_no_config_and_resume_args_are_a_setting():
    p, errors = plan(options={"dsc_ds_config_mode": "none", "dsc_resume_args": []}, full_run=True)
    assert errors == [] and "ds_config.json" not in p["run"]["files"]
    cmd = p["run"]["commands"]["node1"]
    assert not any(a.startswith("--deepspeed") for a in cmd)
    assert p["run"]["resume_args"] == []


def gpu_cluster(gpus_per_node, selections):
    hostvars, groups, probes = cluster(len(selections), slots="auto")
    for i, (h, chosen) in enumerate(zip(groups["cluster"], selections, strict=True)):
        probes[h] = probe(f"10.0.0.{11 + i}", gpus=gpus_per_node)
        if chosen is not None:
            hostvars[h]["dsc_gpus"] = chosen
    return hostvars, groups, probes


def test_gpus_chosen_per_node_reach_the_launcher_as_include():
    hostvars, groups, probes = gpu_cluster(4, [[1, 3], None])
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, full_run=True)
    assert errors == []
    assert p["world_size"] == 6 and p["node"]["node1"]["gpu_ids"] == [1, 3]
    cmd = p["run"]["commands"]["node1"]
    assert cmd[cmd.index("--include") + 1] == "node1:1,3@node2:0,1,2,3"
    # DeepSpeed counts a node's GPUs from 0 in the hostfile; --include picks 1 and 3 of them.
    assert dscplan.parse_hostfile(p["run"]["files"]["hostfile"]) == [("node1", 4), ("node2", 4)]


def test_no_include_without_a_selection():
    hostvars, groups, probes = gpu_cluster(2, [None, None])
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, full_run=True)
    assert errors == [] and "--include" not in p["run"]["commands"]["node1"]


@pytest.mark.parametrize("chosen,slots,needle", [
    ([0, 7], "auto", "dsc_gpus on host node1 names GPU 7, which nvidia-smi does not report there (it has [0, 1, 2, 3])"),
    ([0, 0], "auto", "dsc_gpus on host node1 is [0, 0]. Fix: a list of distinct GPU indices"),
    (["a"], "auto", "dsc_gpus on host node1 is ['a']"),
    ([0, 1], 3, "dsc_slots on host node1 is 3 but dsc_gpus chooses 2 GPUs"),
])
def test_a_bad_gpu_selection_is_refused(chosen, slots, needle):
    hostvars, groups, probes = gpu_cluster(4, [chosen, None])
    hostvars["node1"]["dsc_slots"] = slots
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert p is None and any(needle in e for e in errors), errors


# --- the user's own script: entry shim, launcher options, requirements, data, secrets ---

def test_every_rank_starts_through_the_entry_shim(tmp_path):
    (tmp_path / "train.py").write_text("")
    p, errors = plan(options={"dsc_code_dir": str(tmp_path), "dsc_entry_script": "train.py",
                              "dsc_launcher_args": ["--bind_cores_to_rank", "--no_local_rank"]},
                     full_run=True)
    assert errors == []
    cmd = p["run"]["commands"]["node1"]
    shim = cmd.index(p["helper"])
    assert cmd[shim:shim + 4] == [p["helper"], "entry", "--script", "train.py"]
    # launcher options go before the program, after the plan's own
    assert cmd[shim - 2:shim] == ["--bind_cores_to_rank", "--no_local_rank"]
    cmd = plan(full_run=True)[0]["run"]["commands"]["node1"]
    assert cmd[cmd.index("entry"):cmd.index("entry") + 3] == ["entry", "--module", "train.run"]


@pytest.mark.parametrize("args,needle", [
    (["--hostfile", "/tmp/h"], "dsc_launcher_args holds '--hostfile'"),
    (["--master_port=1"], "dsc_launcher_args holds '--master_port=1'"),
    (["--bind_core_list"], "--bind_core_list needs a value"),
    (["--enable_each_rank_log", "$(id)"], "dsc_launcher_args holds '$(id)'"),
])
def test_launcher_options_outside_the_allowed_set_are_refused(args, needle):
    p, errors = plan(options={"dsc_launcher_args": args}, full_run=True)
    assert p is None and any(needle in e for e in errors), errors


def test_accelerate_gets_the_config_through_its_own_variables():
    p, errors = plan(options={"dsc_ds_config_mode": "hf", "dsc_ds_config_arg": "env"}, full_run=True)
    assert errors == []
    run = p["run"]
    env = dscplan.parse_ds_env(run["files"][".deepspeed_env"])
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == f"{run['dir']}/ds_config.json"
    assert not any(a.startswith("--deepspeed") for a in run["commands"]["node1"])
    assert json.loads(run["files"]["ds_config.json"])["train_micro_batch_size_per_gpu"] == "auto"


def test_a_users_own_monitor_and_checkpoint_storage_are_kept(tmp_path):
    cfg = dict(USER_CONFIG, tensorboard={"enabled": True, "output_path": "/tmp/tb"})
    p, errors = plan(options={"dsc_ds_config_mode": "file", "dsc_ds_config_file": user_file(tmp_path, cfg)},
                     full_run=True)
    assert errors == []
    out = json.loads(p["run"]["files"]["ds_config.json"])
    assert "csv_monitor" not in out and out["tensorboard"]["output_path"] == "/tmp/tb"
    cfg = dict(USER_CONFIG, checkpoint={"use_node_local_storage": False})  # a shared filesystem
    p, errors = plan(options={"dsc_ds_config_mode": "file", "dsc_ds_config_file": user_file(tmp_path, cfg)},
                     full_run=True)
    assert json.loads(p["run"]["files"]["ds_config.json"])["checkpoint"] == {"use_node_local_storage": False}
    assert "ds_config.json" not in plan(options={"dsc_ds_config_mode": "none"}, full_run=True)[0]["run"]["files"]


def wheelhouse(tmp_path, *files):
    d = tmp_path / "wheels"
    d.mkdir()
    for f in files:
        (d / f).write_text("")
    return str(d)


def test_requirements_split_torch_family_and_are_checked_against_the_wheelhouse(tmp_path):
    wh = wheelhouse(tmp_path, "transformers-4.57.6-py3-none-any.whl", "torchvision-0.28.0-cp311-cp311-linux_x86_64.whl",
                    "Datasets-5.0.1-py3-none-any.whl")
    req = tmp_path / "requirements.txt"
    req.write_text("# the script's packages\ndatasets==5.0.1  # comment\n\n")
    p, errors = plan(dsc_requirements=["transformers==4.57.6", "torchvision==0.28.0"],
                     dsc_requirements_file=str(req), dsc_wheelhouse=wh)
    assert errors == []
    assert p["torch_requirements"] == ["torchvision==0.28.0"]
    assert p["requirements"] == ["transformers==4.57.6", "datasets==5.0.1"]
    p, errors = plan(dsc_requirements=["transformers==9.9", "accelerate"], dsc_wheelhouse=wh)
    assert any("'transformers==9.9' is not in dsc_wheelhouse" in e and "it has 4.57.6" in e
               and "scripts/wheelhouse.sh" in e for e in errors), errors
    assert any("'accelerate' is not in dsc_wheelhouse" in e and "none there" in e for e in errors), errors


def test_a_wheelhouse_lock_must_pin_the_plans_torch_deepspeed_and_requirements(tmp_path):
    wh = wheelhouse(tmp_path, "transformers-4.57.6-py3-none-any.whl")
    h = "0" * 64
    lock = tmp_path / "wheels" / "requirements.lock"
    lock.write_text(f"# written by scripts/wheelhouse.sh\ntorch==2.13.0+cpu --hash=sha256:{h}\n"
                    f"deepspeed==0.19.8 --hash=sha256:{h}\ntransformers==4.57.6 --hash=sha256:{h}\n")
    p, errors = plan(dsc_requirements=["transformers==4.57.6"], dsc_wheelhouse=wh,
                     dsc_torch_version="2.13.0", dsc_deepspeed_version="0.19.8")
    assert errors == [] and p["locked"] is True and p["lock"]["from"] == "wheelhouse"
    assert len(p["lock"]["wheels"]) == 3 and p["lock"]["sdists"] == []
    assert p["pip_lock_args"] == p["pip_source_args"] == "--no-index --find-links /opt/dscluster/wheelhouse"
    p, errors = plan(dsc_requirements=["transformers==4.57.6"], dsc_wheelhouse=wh,
                     dsc_torch_version="2.12.0", dsc_deepspeed_version="0.19.8")
    assert any("dsc_wheelhouse on host node1: its lock has torch 2.13.0+cpu, the plan wants torch==2.12.0"
               in e for e in errors), errors
    lock.write_text("torch==2.13.0\n")
    assert any("not a hashed pin" in e for e in plan(dsc_wheelhouse=wh)[1])
    lock.unlink()
    assert plan(dsc_wheelhouse=wh)[0]["locked"] is False


def test_a_node_lock_from_an_index_splits_wheels_from_source_packages(tmp_path):
    h = "0" * 64
    lock = tmp_path / "nodes.lock"
    lines = [f"torch==2.13.0+cpu --hash=sha256:{h}", f"setuptools==80.9.0 --hash=sha256:{h}",
             f"deepspeed==0.19.8 --hash=sha256:{h}  # sdist"]
    lock.write_text("# written by scripts/nodelock.sh\n" + "\n".join(lines) + "\n")
    pins = dict(dsc_torch_version="2.13.0", dsc_deepspeed_version="0.19.8")
    p, errors = plan(dsc_node_lock=str(lock), dsc_pip_index_url="http://10.0.0.5:8080/simple", **pins)
    assert errors == [] and p["lock"] == {"from": "index", "wheels": lines[:2], "sdists": lines[2:]}
    index = "--index-url http://10.0.0.5:8080/simple --trusted-host 10.0.0.5:8080"
    assert p["pip_source_args"] == index
    assert p["pip_lock_args"] == f"{index} --extra-index-url https://download.pytorch.org/whl/cpu"
    # plain HTTP only when every file is checked against the lock
    assert any("plain HTTP, and no dsc_node_lock" in e for e in plan(dsc_pip_index_url="http://10.0.0.5/simple")[1])
    p, errors = plan(dsc_pip_index_url="https://mirror.example/simple")
    assert errors == [] and p["pip_source_args"] == "--index-url https://mirror.example/simple"
    assert p["pip_torch_args"] == "--index-url https://download.pytorch.org/whl/cpu"  # torch from its own
    # source packages need the lock's own setuptools (no isolated, unchecked build environment)
    lock.write_text("\n".join([lines[0], lines[2]]) + "\n")
    assert any("dsc_node_lock on host node1" in e and "no setuptools" in e and "scripts/nodelock.sh" in e
               for e in plan(dsc_node_lock=str(lock), **pins)[1])
    lock.write_text("\n".join(lines[:2]) + "\n")
    assert any("dsc_node_lock on host node1: its lock has deepspeed not at all" in e
               for e in plan(dsc_node_lock=str(lock), **pins)[1])


@pytest.mark.parametrize("var, value, message", [
    ("dsc_node_lock", "/nonexistent/nodes.lock", "which is not a file on the control node"),
    ("dsc_pip_index_url", "ftp://mirror/simple", "Fix: an http(s) URL"),
    ("dsc_pip_index_url", "https://mirror/simple --trusted-host evil", "Fix: an http(s) URL"),
    ("dsc_pip_index_url", "https://mirror/simple;id", "Fix: an http(s) URL"),
    ("dsc_pip_index_url", "https://mirror/$(touch /tmp/pwned)", "Fix: an http(s) URL"),
    ("dsc_pip_index_url", "https://mirror/simple\n--trusted-host evil", "Fix: an http(s) URL"),
    ("dsc_node_lock", "/tmp/../nonexistent/nodes.lock", "which is not a file on the control node"),
])
def test_bad_node_lock_and_index_are_refused(var, value, message):
    errors = plan(**{var: value})[1]
    assert any(f"{var} on host node1" in e and message in e for e in errors), errors


def test_data_dir_synced_or_shared(tmp_path):
    p, errors = plan(dsc_data_dir=str(tmp_path) + "/")
    assert errors == [] and (p["data_dir"], p["data_shared"]) == (str(tmp_path), False)
    p, errors = plan(dsc_data_dir="/shared/datasets/c4", dsc_data_shared=True)  # checked by preflight
    assert errors == [] and p["data_shared"] is True


def test_secrets_reach_the_plan_by_name_only():
    p, errors = plan(dsc_secrets={"HF_TOKEN": "hf_secret_value", "WANDB_API_KEY": "wandb-secret"},
                     full_run=True)
    assert errors == []
    assert p["secret_names"] == ["HF_TOKEN", "WANDB_API_KEY"] and p["rank_env"]["DSC_SECRETS"] == "1"
    text = json.dumps(p)
    assert "hf_secret_value" not in text and "wandb-secret" not in text
    hostvars, groups, probes = cluster(2)
    hostvars["node1"]["dsc_secrets"] = {"HF_TOKEN": "one-value"}
    hostvars["node2"]["dsc_secrets"] = {"HF_TOKEN": "other-value"}
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert any("dsc_secrets differs between nodes (node1; node2)" in e for e in errors), errors
    assert not any("one-value" in e or "other-value" in e for e in errors)


def test_latest_checkpoint_placeholder_only_in_resume_args():
    p, errors = plan(options={"dsc_resume_args": ["--resume_from_checkpoint", "{latest:out/checkpoint-*}"]},
                     full_run=True)
    assert errors == [] and p["run"]["resume_args"][-1] == "{latest:out/checkpoint-*}"
    p, errors = plan(options={"dsc_entry_args": ["{latest:out/checkpoint-*}"]}, full_run=True)
    assert any("dsc_entry_args holds '{latest:out/checkpoint-*}'" in e for e in errors), errors
    p, errors = plan(options={"dsc_resume_args": ["{latest:$(id)}"]}, full_run=True)
    assert any("dsc_resume_args holds '{latest:$(id)}'" in e for e in errors), errors


def test_tensorboard_is_one_setting_and_needs_a_config_the_toolkit_writes():
    p, errors = plan(options={"dsc_tensorboard": True}, full_run=True)
    assert errors == []
    cfg = json.loads(p["run"]["files"]["ds_config.json"])
    assert cfg["tensorboard"] == {"enabled": True, "job_name": "ds", "output_path": f"{p['run']['dir']}/tensorboard/"}
    assert cfg["csv_monitor"]["enabled"]  # DeepSpeed's csv monitor beside it (status reads neither)
    p, errors = plan(options={"dsc_tensorboard": True, "dsc_ds_config_mode": "none"}, full_run=True)
    assert any("dsc_tensorboard is true but dsc_ds_config_mode is 'none'" in e for e in errors), errors


def test_plot_runs_must_be_runs_on_the_master():
    runs = [{"id": "zero2-a", "mtime": 2, "started": True, "active": False},
            {"id": "zero3-b", "mtime": 1, "started": True, "active": False}]
    p, errors = plan(options={"plot_runs": ["zero2-a", "zero3-b"]}, runs=runs)
    assert errors == [] and p["plot_runs"] == ["zero2-a", "zero3-b"]
    assert plan(runs=runs)[0]["plot_runs"] == ["zero2-a"]  # the newest, as status.yml picks
    p, errors = plan(options={"plot_runs": ["../x"]}, runs=runs)
    assert any("plot_runs: no run '../x'" in e and "zero2-a" in e for e in errors), errors


def test_a_run_id_whose_directory_is_a_symbolic_link_on_any_node_is_refused():
    hostvars, groups, probes = cluster(2)
    probes["node2"]["run_root_links"] = ["zero2-20261130-000000"]  # planted at the next default id
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, now="20261130-000000",
                                   full_run=True)
    assert any("run_id 'zero2-20261130-000000': /opt/dscluster/runs/zero2-20261130-000000 on node2 is a "
               "symbolic link" in e and "another run_id" in e for e in errors), errors


def test_jinja_in_an_extra_var_is_refused_wherever_it_hides():
    problems = dscplan.literal_extra_vars({
        "run_id": "{{ lookup('pipe', 'id') }}", "preset": "zero2",
        "dsc_train_config": {"steps": 5, "data_path": "{% raw %}x"}, "dsc_entry_args": ["--a", "{# c #}"]})
    assert [p.split(" holds")[0] for p in problems] == ["run_id", "dsc_train_config.data_path", "dsc_entry_args[1]"]
    assert all("Fix: pass the plain value" in p for p in problems)
    assert dscplan.literal_extra_vars({"run_id": "r1", "x": {"y": [1, "z"]}}) == []


# A '#jinja2:' header sets the delimiters of the rest: none of Jinja's defaults need appear.
HEADERS = [
    "#jinja2:variable_start_string:'[%',variable_end_string:'%]'\n[% lookup('pipe', 'id') %]zero2",
    "#jinja2:line_statement_prefix:'%'\n% set x = lookup('pipe', 'id')\nzero2",
    "#jinja2:comment_start_string:'<#',comment_end_string:'#>'\nzero2<# c #>",
    "#jinja2:trim_blocks:False\nzero2",
]


def ansible_templates():
    """ansible-core's own decisions: its quick check (Templar.is_possibly_template) and its
    engine's (Templar.is_template, on the string trusted as a template, as -e values are).
    Ansible is imported by the tests that compare with it (_datatag is private: if it moves, only
    they fail)."""
    from ansible._internal._datatag._tags import TrustedAsTemplate  # noqa: PLC0415
    from ansible.parsing.dataloader import DataLoader  # noqa: PLC0415
    from ansible.template import Templar  # noqa: PLC0415
    templar = Templar(loader=DataLoader(), variables={})
    return templar, lambda text: (templar.is_possibly_template(text)
                                  or templar.is_template(TrustedAsTemplate().tag(text)))


def test_a_jinja2_header_is_refused_as_ansible_would_evaluate_it():
    """ansible-core evaluates a string that begins with '#jinja2:' with the delimiters it sets
    (an -e @file's preset ran a lookup that way); the plan refuses it, named."""
    from ansible._internal._datatag._tags import TrustedAsTemplate  # noqa: PLC0415 - see ansible_templates
    templar, is_template = ansible_templates()
    assert templar.template(TrustedAsTemplate().tag("#jinja2:variable_start_string:'[%',"
                                                    "variable_end_string:'%]'\n[% 7*7 %]")) == 49
    for text in HEADERS:
        assert is_template(text)
        assert [p.split(" holds")[0] for p in dscplan.literal_extra_vars({"preset": text})] == ["preset"]
        assert [p.split(" holds")[0] for p in dscplan.literal_extra_vars(
            {"dsc_train_config": {"data": [text]}})] == ["dsc_train_config.data[0]"]


def test_every_string_ansible_treats_as_a_template_is_refused():
    """Every string of pieces (delimiters of either kind, a header, line ends, plain text) that
    ansible-core in .venv calls a template is refused by the plan's own check; the action adds
    Ansible's quick check besides, so that a later Ansible's new forms are refused as well."""
    templar, is_template = ansible_templates()
    pieces = ["{", "}", "%", "#", "{{", "{%", "{#", "#jinja2:", "[%", "\n", " ", "x", "'"]
    corpus = {"".join(p) for n in range(1, 4) for p in itertools.product(pieces, repeat=n)}
    corpus |= set(HEADERS) | {" #jinja2:x\n", "\n{{ 1 }}", "{ {", "%}", "}}", "#}"}
    templates = [text for text in sorted(corpus) if is_template(text)]
    assert len(templates) > 500
    missed = [text for text in templates if not dscplan.templates_in(text, "v")]
    assert missed == []
    assert dscplan.templates_in("[% x %]", "v", lambda text: text.startswith("[%")) == ["v"]
    assert not dscplan.templates_in("zero2", "v", templar.is_possibly_template)


def gpus_of(memory_mib, n=1, gpus=1):
    hostvars, groups, probes = cluster(n, slots=gpus, gpus=gpus)
    for p in probes.values():
        for g in p["gpus"]:
            g["memory_mib"] = memory_mib
    return hostvars, groups, probes


def auto_plan(memory_mib, options, n=1, gpus=1):
    hostvars, groups, probes = gpus_of(memory_mib, n, gpus)
    return dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, options, now="20261130-000000",
                              full_run=True)


GPT_1_3B = {"size": "1.3b", "seq_len": 2048}


def test_preset_auto_takes_the_largest_micro_batch_that_fits_and_says_why():
    p, errors = auto_plan(143771, {"preset": "auto", "dsc_train_config": GPT_1_3B})  # one H200
    assert errors == [], errors
    run = p["run"]
    # measured on the H200: micro-batch 16 peaks at 85.3 GiB (x1.3 + 1.5 = 112 GiB fits), 32 does not
    assert (run["preset"], run["batch"]["micro_batch"]) == ("zero1", 16), run["auto"]
    assert run["auto"][0].startswith("preset=auto chose zero1 at micro-batch 16: predicted peak")
    assert "within the smallest GPU (node1: 140.4 GiB)" in run["auto"][0]
    assert json.loads(run["files"]["launch.json"])["preset"] == "zero1"  # resume keeps the choice
    assert run["id"].startswith("zero1-")


def test_preset_auto_falls_back_to_sharding_then_offload_on_small_gpus():
    p, errors = auto_plan(24576, {"preset": "auto", "dsc_train_config": GPT_1_3B})  # a 24 GiB GPU
    assert errors == [] and p["run"]["preset"] in ("zero2-offload", "zero3-offload"), p["run"]["auto"]
    p, errors = auto_plan(143771, {"preset": "auto", "dsc_micro_batch": 4, "dsc_train_config": GPT_1_3B})
    assert errors == [] and p["run"]["batch"]["micro_batch"] == 4  # a given micro-batch is kept
    p, errors = auto_plan(8192, {"preset": "auto", "dsc_train_config": dict(GPT_1_3B, seq_len=8192)})
    assert any("preset=auto: nothing fits the smallest GPU (node1: 8.0 GiB)" in e for e in errors), errors


def test_preset_auto_offloads_with_zero3_on_one_gpu_and_zero2_on_more():
    # the 8.47 B model fits one H200 only with offload (measured there: zero3-offload 5,473 tokens/s,
    # zero2-offload 5,025, both at micro-batch 8 x 2)
    large = {"preset": "auto", "dsc_train_batch": 16, "dsc_train_config": {"size": "8b", "seq_len": 2048}}
    p, errors = auto_plan(143771, large)
    assert errors == [] and (p["run"]["preset"], p["run"]["batch"]["micro_batch"]) == ("zero3-offload", 8), \
        p["run"]["auto"]
    assert any("no room: zero2 micro-batch 1" in line for line in p["run"]["auto"]), p["run"]["auto"]
    p, errors = auto_plan(16384, {"preset": "auto", "dsc_train_config": GPT_1_3B}, n=2)  # two 16 GiB
    assert errors == [] and p["run"]["preset"] == "zero2-offload", p["run"]["auto"]


def test_preset_auto_needs_gpus_and_a_users_script_needs_its_models_shape():
    p, errors = plan(options={"preset": "auto"}, full_run=True)  # CPU nodes
    assert any("preset=auto chooses by GPU memory and the cluster has CPU nodes" in e for e in errors), errors
    script = {"preset": "auto", "dsc_code_dir": str(ROOT / "tests" / "fixtures" / "scripts" / "clm"),
              "dsc_entry_script": "run_clm.py"}
    p, errors = auto_plan(143771, script)
    assert any("preset=auto for run_clm.py needs the model's shape" in e for e in errors), errors
    shape = {"layers": 12, "hidden": 768, "heads": 12, "vocab": 50257, "seq_len": 1024}
    p, errors = auto_plan(143771, dict(script, dsc_model_shape=shape))
    assert errors == [] and p["run"]["preset"] == "zero1", errors
    p, errors = auto_plan(143771, dict(script, dsc_model_shape={"layers": 12}))
    assert any("needs the model's shape (dsc_model_shape gives no hidden, heads, vocab, seq_len)" in e
               for e in errors), errors


# A valid value of each setting and run option, to which a control character is added.
SAMPLES = {
    "dsc_torch_version": "2.5.1", "dsc_deepspeed_version": "0.16.0", "dsc_addr": "10.0.0.11",
    "dsc_run_root": "/opt/dscluster/runs", "dsc_wheelhouse": "/srv/wheels", "dsc_node_lock": "/srv/node.lock",
    "dsc_pip_index_url": "https://pypi.example.org/simple", "dsc_conda_installer_file": "/srv/conda.sh",
    "dsc_conda_installer_sha256": "a" * 64, "dsc_existing_python": "/opt/torch/bin/python",
    "dsc_requirements_file": "/srv/req.txt", "dsc_data_dir": "/data/c4", "dsc_ssh_port": 22,
    "cluster_network_ssh_sources": ["10.0.0.1"], "dsc_rank_env": {"NCCL_IB_HCA": "mlx5"},
    "dsc_requirements": ["transformers==4.57.6"], "dsc_gpus": ["0"], "run_id": "r1",
    "dsc_code_dir": "/shared/code", "dsc_entry_script": "train.py", "dsc_entry_args": ["--steps=1"],
    "dsc_ds_config_file": "/srv/ds.json", "dsc_launcher_args": ["--bind_cores_to_rank"],
    "plot_runs": ["r1"], "dsc_model_shape": {"layers": "2"}, "dsc_slots": "2", "dsc_ds_config_mode": "preset",
    "dsc_ds_config_arg": "--deepspeed_config",
}
HOSTILE_ENDS = ["\n", "\r", "\0"]


def with_end(name, end):
    """SAMPLES' (or the default's) value of a setting with `end` after its (first) string."""
    opt = OPTIONS[name]
    value = SAMPLES.get(name, DEFAULTS[name])
    if opt["type"] == "bool":
        return f"{str(bool(value)).lower()}{end}"
    if opt["type"] == "list":
        return [f"{value[0]}{end}"] + list(value[1:])
    if opt["type"] == "dict":
        return {k: f"{v}{end}" for k, v in value.items()}
    return f"{value}{end}"


# A secret's value may hold anything (only its name is checked: test_control_characters_in_names_are_refused_too).
EVERY_SETTING = [n for n in OPTIONS if n not in dscplan.JSON_ONLY + dscplan.SECRET_SETTINGS]


@pytest.mark.parametrize("end", HOSTILE_ENDS, ids=["LF", "CR", "NUL"])
@pytest.mark.parametrize("name", EVERY_SETTING)
def test_every_setting_with_a_line_end_or_nul_is_refused_naming_it(name, end):
    """Whatever the setting (inventory or -e), a trailing newline, a carriage return or a NUL in
    any of its strings is refused before any node changes, the message naming it and the fix."""
    value = with_end(name, end)
    if name in dscplan.RUN_OPTIONS:
        p, errors = plan(options={name: value}, full_run=True)
    else:
        p, errors = plan(**{name: value})
    assert p is None
    ours = [e for e in errors if e.startswith(name)]
    assert any(f"holds a control character ({end!r})" in e and "Fix:" in e for e in ours), errors


def test_control_characters_in_names_are_refused_too():
    p, errors = plan(dsc_rank_env={"NCCL_IB_HCA\n": "mlx5"}, dsc_secrets={"HF_TOKEN\r": "x"})
    assert any(e.startswith("dsc_rank_env (a key) on host node1 holds a control character ('\\n')") for e in errors), errors
    assert any(e.startswith("dsc_secrets (a name) on host node1 holds a control character ('\\r')") for e in errors), errors


def test_json_only_values_and_secret_values_may_hold_line_ends():
    """train.json and the ds_config are JSON (never a path or a command line); a secret's value
    (a PEM key) reaches only the ranks' environment."""
    p, errors = plan(options={"dsc_train_config": {"prompt": "a\nb"}, "dsc_ds_config_overrides": {"x": "a\n"}},
                     full_run=True, dsc_secrets={"SSH_KEY": "-----BEGIN-----\nabc\n"})
    assert errors == [], errors


@pytest.mark.parametrize("settings,options,needle", [
    ({"dsc_install_root": "/opt/dscluster\n"}, None, "dsc_install_root on host node1 is '/opt/dscluster\\n'"),
    ({"dsc_run_root": "/opt/dscluster/runs\n"}, None, "dsc_run_root on host node1 is '/opt/dscluster/runs\\n'"),
    ({"dsc_data_dir": "/data\n", "dsc_data_shared": True}, None, "dsc_data_dir on host node1 is '/data\\n'"),
    ({"dsc_env_manager": "existing", "dsc_existing_python": "/opt/t/bin/python\n"}, None, "dsc_existing_python on host node1"),
    ({"dsc_torch_version": "2.5.1\n"}, None, "dsc_torch_version on host node1 is '2.5.1\\n'"),
    ({"dsc_train_user": "dstrain\n"}, None, "dsc_train_user on host node1 is 'dstrain\\n'"),
    ({"dsc_python_version": "3.11\n"}, None, "dsc_python_version on host node1"),
    ({"dsc_master_port": "29500\n"}, None, "dsc_master_port on host node1 is '29500\\n'"),
    ({"dsc_pg_timeout_min": "30\n"}, None, "dsc_pg_timeout_min on host node1"),
    ({"dsc_rank_env": {"NCCL_IB_HCA": "mlx5\n"}}, None, "the value of NCCL_IB_HCA is 'mlx5\\n'"),
    ({"dsc_rank_env": {"NCCL_IB_HCA\n": "mlx5"}}, None, "'NCCL_IB_HCA\\n' is not a plain variable name"),
    ({"dsc_secrets": {"HF_TOKEN\n": "x"}}, None, "'HF_TOKEN\\n' is not a plain variable name"),
    ({"cluster_network_ssh_sources": ["10.0.0.1\n"]}, None, "cluster_network_ssh_sources on host node1"),
    ({"dsc_addr": "127.0.0.1\n"}, None, "dsc_addr on host node1"),
    ({"dsc_slots": "2\n"}, None, "dsc_slots on host node1 is '2\\n'"),
    ({"dsc_ssh_port": "22\r"}, None, "dsc_ssh_port on host node1 is '22\\r'"),
    ({"dsc_gpus": ["0\n"]}, None, "dsc_gpus on host node1"),
    ({}, {"run_id": "r1\n"}, "run_id is 'r1\\n'"),
    ({}, {"dsc_entry_args": ["--steps=1\n", "touch", "/tmp/x"]}, "dsc_entry_args holds '--steps=1\\n'"),
    ({}, {"dsc_launcher_args": ["--bind_core_list", "0-3\n"]}, "dsc_launcher_args holds '0-3\\n'"),
    ({}, {"dsc_resume_args": ["--resume_from_checkpoint", "{latest:out/checkpoint-*}\n"]}, "dsc_resume_args holds"),
    ({}, {"dsc_entry_module": "train.run\n"}, "dsc_entry_module is 'train.run\\n'"),
    ({}, {"dsc_code_dir": "/shared/code\n", "dsc_code_shared": True}, "dsc_code_dir (dsc_code_shared) is '/shared/code\\n'"),
    ({}, {"max_restarts": "1\n"}, "max_restarts is '1\\n'"),
    ({}, {"dsc_micro_batch": "2\n"}, "batch settings must be whole numbers"),
    ({}, {"preset": "zero2\n"}, "preset is 'zero2\\n'"),
])
def test_every_check_matches_the_whole_string(monkeypatch, settings, options, needle):
    """Each setting's own check, without the control-character pass in front of it: `$` took a
    trailing newline, fullmatch does not."""
    monkeypatch.setattr(dscplan, "control_characters", lambda *a: None)
    p, errors = plan(options=options, full_run=options is not None, **settings)
    assert p is None and any(needle in e for e in errors), errors
    assert all("Fix:" in e for e in errors), errors


@pytest.mark.parametrize("settings,options,needle", [
    ({"dsc_install_root": "/"}, None, "dsc_install_root on host node1 is '/', the root directory"),
    ({"dsc_install_root": "/etc"}, None, "dsc_install_root on host node1 is '/etc', in the system tree /etc"),
    ({"dsc_install_root": "/usr/local/dscluster"}, None, "is '/usr/local/dscluster', in the system tree /usr"),
    ({"dsc_install_root": "/var"}, None, "is '/var', the system directory /var itself"),
    ({"dsc_install_root": "/home/"}, None, "is '/home/', the system directory /home itself"),
    ({"dsc_install_root": "//etc"}, None, "is '//etc', in the system tree /etc"),
    ({"dsc_install_root": "/lib64/x"}, None, "in the system tree /lib64"),
    ({"dsc_run_root": "/"}, None, "dsc_run_root on host node1 is '/', the root directory"),
    ({"dsc_run_root": "/etc"}, None, "dsc_run_root on host node1 is '/etc', in the system tree /etc"),
    ({"dsc_run_root": "/tmp"}, None, "dsc_run_root on host node1 is '/tmp', the system directory /tmp itself"),
    ({"dsc_run_root": "/var/run/ds"}, None, "in the system tree /var/run"),
    ({"dsc_run_root": "/root/runs"}, None, "in the system tree /root"),
    ({"dsc_run_root": "/proc/1/cwd"}, None, "in the system tree /proc"),
    ({"dsc_data_dir": "/etc", "dsc_data_shared": True}, None, "dsc_data_dir on host node1 is '/etc', in the system tree /etc"),
    ({"dsc_data_dir": "/"}, None, "dsc_data_dir on host node1 is '/', the root directory, and launch makes it the training user's and syncs"),
    ({"dsc_data_dir": "/boot"}, None, "dsc_data_dir on host node1 is '/boot'"),
    ({"dsc_env_manager": "existing", "dsc_existing_python": "/bin/python3"}, None,
     "dsc_existing_python on host node1 is '/bin/python3', whose env '/' is the root directory"),
    ({"dsc_env_manager": "existing", "dsc_existing_python": "/tmp/bin/python"}, None,
     "whose env '/tmp' is the system directory /tmp itself"),
    ({"dsc_env_manager": "existing", "dsc_existing_python": "/root/.venv/bin/python"}, None,
     "whose env '/root/.venv' is in the system tree /root"),
    ({"dsc_env_manager": "existing", "dsc_existing_python": "/opt/torch/python"}, None,
     "not in an env's bin directory"),
    ({}, {"dsc_code_dir": "/usr", "dsc_code_shared": True}, "dsc_code_dir (dsc_code_shared) is '/usr', in the system tree /usr"),
    ({}, {"dsc_code_dir": "/", "dsc_code_shared": True}, "dsc_code_dir (dsc_code_shared) is '/', the root directory"),
])
def test_system_directories_are_refused_as_roots(settings, options, needle):
    """A root the toolkit gives to the training user (and the dataset's, synced with delete)
    is never /, a system tree or a shared root itself, before any node changes."""
    p, errors = plan(options=options, full_run=options is not None, **settings)
    assert p is None and any(needle in e and "Fix: a directory of the toolkit's own" in e
                             or needle in e and "Fix: the interpreter of an env of its own" in e
                             for e in errors), errors


@pytest.mark.parametrize("settings", [
    {"dsc_install_root": "/opt/dscluster", "dsc_run_root": "/var/lib/dscluster/runs"},
    {"dsc_run_root": "/home/alice/runs"}, {"dsc_run_root": "/tmp/dsc-runs"}, {"dsc_install_root": "/srv/ds/"},
    {"dsc_data_dir": "/mnt/datasets/c4", "dsc_data_shared": True}, {"dsc_run_root": "/library/runs"},
    {"dsc_env_manager": "existing", "dsc_existing_python": "/usr/bin/python3"},
    {"dsc_env_manager": "existing", "dsc_existing_python": "/usr/local/bin/python3"},
    {"dsc_env_manager": "existing", "dsc_existing_python": "/opt/conda/envs/ds/bin/python"},
])
def test_directories_of_their_own_under_shared_roots_are_accepted(settings):
    hostvars, groups, probes = cluster(2, **settings)
    for pr in probes.values():
        pr["existing_python"] = owned(settings.get("dsc_existing_python", ""))
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert errors == [], errors


def owned(py, owners=(), mode="0o755"):
    """What the probe reports of an interpreter (dscnode.probe.path_owners): each directory above it
    root's, then the ones named in `owners` ({path: (uid, user)}), every mode `mode`."""
    parts = py.split("/")[1:]
    chain = ["/"] + ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]
    owners = dict(owners)
    return {"path": py, "entries": [
        {"path": p, "uid": owners.get(p, (0, "root"))[0], "user": owners.get(p, (0, "root"))[1],
         "mode": mode if p != py else "0o755", "kind": "file" if p == py else "dir"} for p in chain]}


def existing_plan(reports):
    py = "/opt/torch/.venv/bin/python"
    hostvars, groups, probes = cluster(2, dsc_env_manager="existing", dsc_existing_python=py)
    for node, report in zip(probes, reports, strict=True):
        if report is not None:
            probes[node]["existing_python"] = report
    return dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)


def test_an_existing_interpreter_runs_as_root_only_when_it_is_roots_alone():
    py = "/opt/torch/.venv/bin/python"
    p, errors = existing_plan([owned(py), owned(py)])
    assert errors == [] and p["env_owner"] == "root"
    users = {"/opt/torch": (1001, "dstrain"), "/opt/torch/.venv": (1001, "dstrain")}
    p, errors = existing_plan([owned(py, users), owned(py, users)])
    assert errors == [] and p["env_owner"] == "dstrain"  # run only as its owner, never as root


@pytest.mark.parametrize("reports,needle", [
    ([owned("/opt/torch/.venv/bin/python", mode="0o775")] * 2,
     "dsc_existing_python on host node1 is '/opt/torch/.venv/bin/python': / is writable by group (mode 775, owner root)"),
    ([owned("/opt/torch/.venv/bin/python", {"/opt/torch/.venv/bin": (0, "root")}, mode="0o757")] * 2,
     "is writable by others (mode 757, owner root)"),
    ([owned("/opt/torch/.venv/bin/python", {"/opt/torch": (1001, "dstrain"), "/opt/torch/.venv": (1002, "alice")})] * 2,
     "parts of it belong to alice, dstrain (not only root)"),
    ([{"path": "/opt/torch/.venv/bin/python", "error": "/opt/torch/.venv/bin/python is not a file"}] * 2,
     "dsc_existing_python on host node1 is '/opt/torch/.venv/bin/python', which is not there"),
    ([owned("/opt/torch/.venv/bin/python"), None], "node2 is '/opt/torch/.venv/bin/python', which is not there (the probe did not look at it)"),
    ([owned("/opt/torch/.venv/bin/python"), owned("/opt/torch/.venv/bin/python", {"/opt/torch": (1001, "dstrain")})],
     "owned by root on node1; dstrain on node2"),
])
def test_an_existing_interpreter_others_could_change_is_refused_saying_why(reports, needle):
    p, errors = existing_plan(reports)
    assert p is None and any(needle in e and "Fix:" in e for e in errors), errors


@pytest.mark.parametrize("node1,needle", [
    ({"dsc_addr": "node1.lab.example"}, "dsc_addr on host node1 is 'node1.lab.example', a host name, not an IPv4 address"),
    ({"dsc_addr": None, "ansible_host": "gpu1.lab"},
     "dsc_addr on host node1 is unset and ansible_host, which stands for it, is 'gpu1.lab', a host name"),
    ({"dsc_addr": None}, "dsc_addr on host node1 is unset, and so is ansible_host: the inventory name 'node1' stands for it, a host name"),
    ({"dsc_addr": "fd89:77::11"}, "dsc_addr on host node1 is 'fd89:77::11', an IPv6 address: IPv6 training addresses are not supported yet"),
    ({"dsc_addr": "fe80::1%eth0"}, "an IPv6 address: IPv6 training addresses are not supported yet"),
    ({"dsc_addr": "::ffff:10.0.0.11"}, "are not supported yet (the probe, NCCL's interface and the rendezvous are IPv4 here; the firewall covers both families). Fix: set dsc_addr to the node's IPv4 address on the training network, e.g. 10.0.0.11 (10.0.0.11 here)."),
    ({"dsc_addr": "0.0.0.0"}, "dsc_addr on host node1 is '0.0.0.0', not the address of one node"),
    ({"dsc_addr": "224.0.0.1"}, "not the address of one node"),
    ({"dsc_addr": "10.0.0.300"}, "dsc_addr on host node1 is '10.0.0.300', not an IPv4 address. Fix: set dsc_addr"),
])
def test_a_training_address_is_an_ipv4_address_of_one_node(node1, needle):
    """Host names and IPv6 passed the plan and failed in the firewall filter after other roles
    had changed the nodes: refused by the plan now, before any node changes, saying which."""
    hostvars, groups, probes = cluster(2)
    hostvars["node1"].update(node1)
    hostvars["node1"] = {k: v for k, v in hostvars["node1"].items() if v is not None}
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, full_run=True)
    assert p is None and any(needle in e and "Fix:" in e for e in errors), errors


def secrets_run(names, on=("node1", "node2")):
    """A stopped run launched with secrets `names`, its secrets file on the nodes `on`."""
    spec = {"preset": "zero2", "secret_names": list(names)}
    hostvars, groups, probes = cluster(2)
    for node in probes:
        probes[node]["runs"] = [{"id": "r1", "mtime": 1, "started": True, "active": False,
                                 "launch": spec, "secrets": node in on}]
    return hostvars, groups, probes


def test_resume_gives_the_ranks_the_runs_own_secrets_or_refuses_naming_them():
    """Resume without dsc_secrets: the run's own (0600, beside it) reach its ranks (DSC_SECRETS
    in the launcher's environment, which the supervisor's restarts keep); gone on a node, or
    given again without one of them, resume refuses naming the secrets, before any change."""
    hostvars, groups, probes = secrets_run(["WANDB_API_KEY"])
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {"resume": True}, full_run=True)
    assert errors == [] and p["run"]["id"] == "r1" and p["run"]["env"]["DSC_SECRETS"] == "1"
    assert p["secret_names"] == []  # nothing written anew: the run's own file is used
    assert p["run"]["secrets_file"] == "/opt/dscluster/runs/.secrets/r1.json"

    hostvars, groups, probes = secrets_run(["WANDB_API_KEY"], on=("node1",))
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {"resume": True}, full_run=True)
    assert p is None and any(
        "dsc_secrets: run 'r1' was launched with WANDB_API_KEY, and its secrets file "
        "(/opt/dscluster/runs/.secrets/r1.json) is gone on node2" in e and "Fix: give dsc_secrets again" in e
        for e in errors), errors

    hostvars, groups, probes = secrets_run(["HF_TOKEN", "WANDB_API_KEY"])
    for hv in hostvars.values():
        hv["dsc_secrets"] = {"HF_TOKEN": "x"}
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {"resume": True}, full_run=True)
    assert p is None and any("leaves out WANDB_API_KEY" in e and "Fix: give every one of them" in e
                             for e in errors), errors
    for hv in hostvars.values():
        hv["dsc_secrets"] = {"HF_TOKEN": "x", "WANDB_API_KEY": "y"}
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {"resume": True}, full_run=True)
    assert errors == [] and p["secret_names"] == ["HF_TOKEN", "WANDB_API_KEY"]  # written anew

    hostvars, groups, probes = secrets_run([], on=())  # a run without secrets: nothing to load
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {"resume": True}, full_run=True)
    assert errors == [] and "DSC_SECRETS" not in p["run"]["env"]


def test_a_launch_records_its_secret_names_never_their_values():
    p, errors = plan(dsc_secrets={"WANDB_API_KEY": "wandb-secret"}, full_run=True)
    spec = json.loads(p["run"]["files"]["launch.json"])
    assert spec["secret_names"] == ["WANDB_API_KEY"] and "wandb-secret" not in json.dumps(p)


def test_the_plans_secrets_path_is_the_node_helpers():
    assert str(secrets_file("/opt/dscluster/runs/r1")) == dscplan.secrets_path("/opt/dscluster/runs", "r1")


GPT2_CONFIG = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 24, "n_embd": 2048,
               "n_head": 16, "n_positions": 2048, "vocab_size": 50257, "attn_pdrop": 0.1, "resid_pdrop": 0.1,
               "embd_pdrop": 0.1, "n_inner": None, "torch_dtype": "float32"}


def users_code(tmp_path, config=None):
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text("print('train')\n")
    if config is not None:
        (code / "config.json").write_text(json.dumps(config))
    return {"preset": "auto", "dsc_code_dir": str(code), "dsc_entry_script": "train.py", "dsc_train_batch": 32}


def test_preset_auto_reads_the_models_config_json_and_says_what_it_assumed(tmp_path):
    """The issue's model (GPT2LMHeadModel from a config, one H200, a batch of 32): config.json
    alone gives the shape; with no attn_implementation it assumes eager and says so; dropout,
    tied embeddings and the longest sequence are read from it; dsc_model_shape keys override."""
    p, errors = auto_plan(143771, users_code(tmp_path, GPT2_CONFIG))
    assert errors == [], errors
    lines = p["run"]["auto"]
    model = next(line for line in lines if line.startswith("  model ("))
    assert "config.json): 24 layers, hidden 2048, 16 heads, vocab 50257, seq_len 2048, attention eager, " \
           "dropout on, activation gelu_new, logits fp32, tied embeddings" in model, lines
    assert any(line.startswith("  assumed: attention eager (config.json names no attn_implementation") for line in lines)
    assert any(line.startswith("  assumed: activation gelu_new (config.json names no activation_function")
               for line in lines), lines
    assert any("seq_len 2048 from config.json's n_positions" in line for line in lines)
    eager_mb = p["run"]["batch"]["micro_batch"]
    # eager attention with its dropout: 4 sequences, where sdpa's prediction took 16 (and ran out of memory)
    assert eager_mb == 4, lines
    # told sdpa and no dropout (the config names them): a larger micro-batch, nothing assumed there;
    # 16 where the config names a fused GELU, 8 with GPT-2's composed gelu_new (3 more 4h tensors)
    quiet = dict(GPT2_CONFIG, _attn_implementation="sdpa", attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    p, errors = auto_plan(143771, users_code(tmp_path, dict(quiet, activation_function="gelu_pytorch_tanh")))
    assert errors == [] and p["run"]["batch"]["micro_batch"] == 16, p["run"]["auto"]
    assert not any("assumed: attention" in line or "assumed: activation" in line for line in p["run"]["auto"])
    p, errors = auto_plan(143771, users_code(tmp_path, dict(quiet, activation_function="gelu_new")))
    assert errors == [] and p["run"]["batch"]["micro_batch"] == 8, p["run"]["auto"]
    assert not any("assumed: activation" in line for line in p["run"]["auto"])
    # dsc_model_shape over config.json: eager without dropout at micro-batch 8. The issue's run measured
    # 78.56 GiB at zero2 micro-batch 8, which the fused-GELU count predicts within 2 %; GPT-2's gelu_new
    # keeps 3 more tensors of 4h per token and layer (measured on the H200: bench/results/gpu/user-auto):
    # 24 x 2048 x 8 x 8192 x 2 x 3 bytes = 18 GiB more at micro-batch 8
    opts = dict(users_code(tmp_path, GPT2_CONFIG), dsc_model_shape={"dropout": 0, "activation": "gelu"},
                dsc_micro_batch=8, preset="auto")
    p, errors = auto_plan(143771, opts)
    assert errors == [], errors
    memory = json.loads(p["run"]["files"]["memory.json"])
    assert memory["micro_batch"] == 8 and 77.5 * 2**30 < memory["predicted"] < 80 * 2**30, memory
    composed = json.loads(auto_plan(143771, dict(opts, dsc_model_shape={"dropout": 0}))[0]["run"]["files"]
                          ["memory.json"])
    assert composed["predicted"] - memory["predicted"] == 24 * 2048 * 8 * 8192 * 2 * 3 == 18 * 2**30
    # an untied output layer counts its own weights
    untied = json.loads(auto_plan(143771, dict(opts, dsc_model_shape={"dropout": 0, "activation": "gelu",
                                                                      "tied": False}))[0]["run"]
                        ["files"]["memory.json"])
    assert untied["predicted"] > memory["predicted"]


def test_a_llama_config_gives_a_gated_mlp_and_no_position_embedding(tmp_path):
    values, notes = dsc_memory.hf_config_shape({
        "model_type": "llama", "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
        "intermediate_size": 8192, "max_position_embeddings": 4096, "vocab_size": 128256,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "attn_implementation": "flash_attention_2"})
    assert values == {"layers": 16, "hidden": 2048, "heads": 32, "vocab": 128256, "seq_len": 4096,
                      "intermediate": 8192, "gated": True, "positions": False, "tied": False,
                      "attention": "sdpa", "attention_dropout": False, "logits": "fp32"}
    assert any("max_position_embeddings" in n for n in notes)
    shape = train_memory.model_shape(16, 2048, 32, 128256, 4096, tied=False, intermediate=8192, gated=True,
                                   positions=False)
    assert shape["params"] == 2 * 128256 * 2048 + 16 * (4 * 2048 ** 2 + 3 * 2048 * 8192 + 4 * 2048) + 2 * 2048
    # a config.json without a model size is not a model's (another program's settings)
    p, errors = auto_plan(143771, users_code(tmp_path, {"lr": 0.1}))
    assert any("preset=auto for train.py needs the model's shape" in e for e in errors), errors


@pytest.mark.parametrize("given,said", [
    ({"layers": 2, "hidden": 64, "heads": 2, "vocab": 100, "seq_len": 64, "attention": "xformers"}, "bad values for ['attention']"),
    ({"layers": 2, "hidden": 64, "heads": 2, "vocab": 100, "seq_len": 64, "dropout": 1.5}, "bad values for ['dropout']"),
    ({"layers": 2, "hidden": 64, "heads": 2, "vocab": 100, "seq_len": 64, "window": 4}, "unknown keys ['window']"),
    ({"config": "nope/config.json"}, "dsc_model_shape.config is 'nope/config.json', which is not a file"),
])
def test_dsc_model_shape_refuses_unknown_keys_and_bad_values_naming_them(tmp_path, given, said):
    p, errors = auto_plan(143771, dict(users_code(tmp_path), dsc_model_shape=given))
    assert any(said in e and "Fix:" in e for e in errors), errors


def test_a_shape_without_attention_or_dropout_assumes_the_larger_and_says_so(tmp_path):
    shape = {"layers": 12, "hidden": 768, "heads": 12, "vocab": 50257, "seq_len": 1024}
    p, errors = auto_plan(143771, dict(users_code(tmp_path), dsc_model_shape=shape))
    assert errors == [], errors
    assumed = [line for line in p["run"]["auto"] if line.startswith("  assumed: ")]
    assert [a.split(" (")[0].split(": ")[1] for a in assumed] == \
        ["attention eager", "dropout on", "logits fp32 in the loss", "activation gelu_new", "untied embeddings"]
    told = dict(shape, attention="flash", dropout=0, logits="bf16", tied=True, activation="gelu")
    p, errors = auto_plan(143771, dict(users_code(tmp_path), dsc_model_shape=told))
    assert errors == [] and not any(line.startswith("  assumed: ") for line in p["run"]["auto"])


def test_preset_auto_writes_its_step_down_ladder_each_step_smaller_by_the_failed_ones_error(tmp_path):
    """auto.json: the chosen configuration first, then each next candidate of auto's own order
    predicted to fit even when off by as much as the failed one must have been; each with its
    ds_config and batch (the global batch kept); the steps are said in auto's lines."""
    shape = dict(GPT2_CONFIG, _attn_implementation="sdpa", attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                 activation_function="gelu_pytorch_tanh")
    p, errors = auto_plan(143771, users_code(tmp_path, shape))
    assert errors == [], errors
    steps = json.loads(p["run"]["files"]["auto.json"])
    ladder = steps["ladder"]
    assert steps["index"] == 0 and (ladder[0]["preset"], ladder[0]["micro_batch"]) == ("zero1", 16)
    room = 143771
    for a, b in itertools.pairwise(ladder):
        assert b["predicted"] <= a["predicted"] * (room - 1536) / 1.3 / room
    for step in ladder:
        cfg = step["ds_config"]
        assert cfg["train_micro_batch_size_per_gpu"] == step["micro_batch"]
        assert cfg["train_batch_size"] == 32 == step["micro_batch"] * step["grad_accum"]
        assert cfg["zero_optimization"]["stage"] == int(step["preset"][4])
    assert ladder[0]["ds_config"] == json.loads(p["run"]["files"]["ds_config.json"])
    said = next(line for line in p["run"]["auto"] if "steps down to" in line)
    assert said.endswith(", then ".join(f"{s['preset']} micro-batch {s['micro_batch']}" for s in ladder[1:]))
    # a micro-batch the user named is never changed: the ladder changes the preset only
    p, errors = auto_plan(143771, dict(users_code(tmp_path, shape), dsc_micro_batch=16))
    assert errors == []
    named = json.loads(p["run"]["files"].get("auto.json", '{"ladder": []}'))["ladder"]
    assert all(s["micro_batch"] == 16 for s in named)
    # a named preset has no ladder
    p, errors = auto_plan(143771, dict(users_code(tmp_path, shape), preset="zero2"))
    assert errors == [] and "auto.json" not in p["run"]["files"] and "memory.json" in p["run"]["files"]


def test_no_step_down_where_the_launchers_run_apart_and_said_so(tmp_path):
    shape = dict(GPT2_CONFIG, _attn_implementation="sdpa", attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    hostvars, groups, probes = gpus_of(143771, n=2)
    for hv in hostvars.values():
        hv["dsc_launch_mode"] = "no_ssh"
    p, errors = dscplan.make_plan(hostvars, groups, probes, dict(DEFAULTS, dsc_launch_mode="no_ssh"), PATHS,
                                   users_code(tmp_path, shape), now="20261130-000000", full_run=True)
    assert errors == [], errors
    assert "auto.json" not in p["run"]["files"]
    assert any("no step down after an out-of-memory error: dsc_launch_mode no_ssh" in line for line in p["run"]["auto"])


def test_a_measured_peak_over_the_prediction_scales_a_later_auto_of_the_same_code_and_model(tmp_path):
    """A run's record on a node (the probe's runs: memory, from its memory.json and the ranks'
    measured peaks) with the same key: a later preset=auto uses the measured figure for the
    same configuration and scales the others by its ratio; a changed model (another key) not."""
    opts = dict(users_code(tmp_path, GPT2_CONFIG), dsc_model_shape={"attention": "sdpa", "dropout": 0,
                                                                     "activation": "gelu"})
    first, errors = auto_plan(143771, opts)
    assert errors == [] and (first["run"]["preset"], first["run"]["batch"]["micro_batch"]) == ("zero1", 16)
    memory = json.loads(first["run"]["files"]["memory.json"])
    measured = int(memory["predicted"] * 1.44)  # eager ran, not sdpa
    record = dict(memory, measured=measured, ratio=round(measured / memory["predicted"], 3))
    hostvars, groups, probes = gpus_of(143771)
    probes["node1"]["runs"] = [{"id": "zero1-earlier", "mtime": 1.0, "started": True, "active": False,
                                "finished": False, "launch": {}, "memory": record}]
    later, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, opts,
                                       now="20261130-000001", full_run=True)
    assert errors == [], errors
    lines = later["run"]["auto"]
    assert later["run"]["batch"]["micro_batch"] < 16, lines
    assert "scaled by the measured x1.44" in lines[0], lines
    assert any(line.startswith("  measured before (run zero1-earlier on node1, zero1 micro-batch 16): ")
               for line in lines), lines
    assert any(line.startswith("  no room: zero1 micro-batch 16: predicted ") and ", measured " in line
               for line in lines), lines
    # within 5 % the model is trusted; another model (a corrected shape) has another key
    probes["node1"]["runs"][0]["memory"] = dict(record, ratio=1.03, measured=int(memory["predicted"] * 1.03))
    again, _ = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, opts, now="20261130-000002", full_run=True)
    assert again["run"]["batch"]["micro_batch"] == 16
    probes["node1"]["runs"][0]["memory"] = record
    other = dict(opts, dsc_model_shape={"attention": "eager", "dropout": 0, "activation": "gelu"})
    fixed, _ = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, other, now="20261130-000003", full_run=True)
    assert not any("measured before" in line or "x1.44" in line for line in fixed["run"]["auto"])


def test_preset_auto_on_cpu_nodes_plans_for_the_memory_it_is_given(tmp_path):
    shape = {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 50257, "seq_len": 2048, "attention": "sdpa",
             "dropout": 0, "tied": True}
    opts = dict(users_code(tmp_path), dsc_model_shape=shape, dsc_train_batch=64)
    p, errors = plan(options=opts, full_run=True)
    assert any("(-e dsc_auto_memory_gib=N" in e for e in errors), errors
    p, errors = plan(options=dict(opts, dsc_auto_memory_gib=300), full_run=True)
    assert errors == [], errors
    assert "within dsc_auto_memory_gib: 300.0 GiB" in p["run"]["auto"][0], p["run"]["auto"]
    ladder = json.loads(p["run"]["files"]["auto.json"])["ladder"]
    assert len(ladder) > 1 and not any("offload" in s["preset"] for s in ladder)
    assert "memory.json" not in p["run"]["files"]  # nothing measures a CPU rank's peak
    p, errors = plan(options=dict(opts, dsc_auto_memory_gib="lots"), full_run=True)
    assert any(e.startswith("dsc_auto_memory_gib is 'lots'. Fix:") for e in errors), errors


def chain(*entries):
    """A probe's lstat chain: (path, kind, user[, target]) each."""
    return [dict({"path": p, "kind": k, "uid": 0 if u == "root" else 1000, "user": u, "mode": "0o755"},
                 **({"target": t[0]} if t else {})) for p, k, u, *t in entries]


def root_paths(*extra):
    base = [{"var": "dsc_install_root", "path": "/opt/dscluster", "role": "made",
             "chain": chain(("/", "dir", "root"), ("/opt", "dir", "root"), ("/opt/dscluster", "dir", "dstrain"))}]
    return base + list(extra)


def plan_with_paths(report, full_run=False, **settings):
    hostvars, groups, probes = cluster(1, **settings)
    probes["node1"]["root_paths"] = report
    return dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, now="20261130-000000",
                              full_run=full_run, check_dir=lambda p: True)


def test_clean_root_paths_pass():
    p, errors = plan_with_paths(root_paths(
        {"var": "dsc_install_root", "path": "/opt/dscluster/cache", "role": "user",
         "chain": chain(("/", "dir", "root"), ("/opt", "dir", "root"), ("/opt/dscluster", "dir", "dstrain"),
                        ("/opt/dscluster/cache", "dir", "dstrain"))}))
    assert errors == [] and p["node"]["node1"]["local"] is False


@pytest.mark.parametrize("entry,needles", [
    ({"var": "dsc_install_root", "path": "/opt/dscluster/cache/torch_extensions", "role": "user",
      "chain": chain(("/", "dir", "root"), ("/opt", "dir", "root"), ("/opt/dscluster", "dir", "dstrain"),
                     ("/opt/dscluster/cache", "link", "dstrain", "/etc"))},
     ["dsc_install_root on host node1: root writes /opt/dscluster/cache/torch_extensions",
      "/opt/dscluster/cache is a link to /etc owned by dstrain", "Fix: remove the link (rm /opt/dscluster/cache"]),
    ({"var": "dsc_train_user", "path": "/home/dstrain/.ssh", "role": "user",
      "chain": chain(("/", "dir", "root"), ("/home", "dir", "root"), ("/home/dstrain", "dir", "dstrain"),
                     ("/home/dstrain/.ssh", "link", "dstrain", "/root/.ssh"))},
     ["dsc_train_user on host node1", "/home/dstrain/.ssh is a link to /root/.ssh"]),
    ({"var": "dsc_run_root", "path": "/srv/runs", "role": "user",
      "chain": chain(("/", "dir", "root"), ("/srv", "dir", "root"), ("/srv/runs", "dir", "alice"))},
     ["dsc_run_root on host node1", "/srv/runs is owned by alice, not dstrain or root", "Fix: point dsc_run_root"]),
    ({"var": "dsc_install_root", "path": "/home/dstrain/dsc", "role": "made",
      "chain": chain(("/", "dir", "root"), ("/home", "dir", "root"), ("/home/dstrain", "dir", "dstrain"),
                     ("/home/dstrain/dsc", "missing", ""))},
     ["the directory above it, /home/dstrain, is owned by dstrain", "Fix: set dsc_install_root under"]),
    ({"var": "node helper", "path": "/usr/local/lib/dscluster", "role": "root",
      "chain": chain(("/", "dir", "root"), ("/usr", "dir", "root"), ("/usr/local", "dir", "root"),
                     ("/usr/local/lib", "dir", "root"), ("/usr/local/lib/dscluster", "dir", "dstrain"))},
     ["node helper on host node1", "/usr/local/lib/dscluster is owned by dstrain, not root", "chown root:root"]),
])
def test_a_link_or_a_foreign_owner_at_a_root_path_is_refused_naming_it(entry, needles):
    p, errors = plan_with_paths(root_paths(entry))
    assert p is None and len(errors) == 1, errors
    for needle in needles:
        assert needle in errors[0]
    assert "nothing was changed" in errors[0]


def test_a_root_owned_link_in_a_root_directory_is_the_systems_layout():
    p, errors = plan_with_paths([{"var": "dsc_install_root", "path": "/opt/dscluster", "role": "made",
                                  "chain": chain(("/", "dir", "root"), ("/opt", "link", "root", "var/opt"))}])
    assert errors == []


def test_the_data_dir_is_checked_at_launch_only_and_never_on_the_control_node_itself():
    data = {"var": "dsc_data_dir", "path": "/home/alice/data", "role": "user",
            "chain": chain(("/", "dir", "root"), ("/home", "dir", "root"), ("/home/alice", "dir", "alice"),
                           ("/home/alice/data", "dir", "alice"))}
    assert plan_with_paths(root_paths(data), dsc_data_dir="/home/alice/data")[1] == []
    _, errors = plan_with_paths(root_paths(data), full_run=True, dsc_data_dir="/home/alice/data")
    assert any("dsc_data_dir on host node1" in e and "owned by alice" in e for e in errors), errors
    # The one-node default: the node is the control node, its data dir the source, left alone.
    p, errors = plan_with_paths(root_paths(data), full_run=True, dsc_data_dir="/home/alice/data",
                                ansible_connection="local")
    assert not any("dsc_data_dir" in e for e in errors), errors


def test_preset_auto_on_the_benchmarked_gpt2_chooses_what_fit_the_h200(tmp_path):
    """bench/user_gpt2 (GPT2LMHeadModel, its config.json naming no activation: GPT2Config's composed
    gelu_new, assumed and said) on one H200 (140.4 GiB), a batch of 32, as bench/gpu_user_auto.sh ran
    it: the measured peaks (bench/results/gpu/user-auto/summary.json) of what auto chooses fit. sdpa no
    longer takes zero1 at micro-batch 16 (measured 133.3 GiB allocated, 138.3 reserved, of 140.4):
    with gelu_new counted its prediction (127.2 GiB) x1.3 + 1.5 GiB does not fit."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "config.json").write_text((ROOT / "bench" / "user_gpt2" / "config.json").read_text())
    (code / "user_gpt2.py").write_text("print('train')\n")
    rows = json.loads((ROOT / "bench" / "results" / "gpu" / "user-auto" / "summary.json").read_text())["rows"]
    measured = {(r["attn"], r["preset"], r["micro_batch"]): r["measured_gib"] for r in rows}
    shape = {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 50257, "seq_len": 2048}
    chose = {}
    for attention in ("eager", "sdpa"):
        given = dict(shape, attention="sdpa") if attention == "sdpa" else shape
        p, errors = auto_plan(143771, {"preset": "auto", "dsc_code_dir": str(code), "dsc_entry_script": "user_gpt2.py",
                                       "dsc_train_batch": 32, "dsc_model_shape": given})
        assert errors == [], errors
        run, lines = p["run"], p["run"]["auto"]
        chose[attention] = (run["preset"], run["batch"]["micro_batch"])
        assert any(line.startswith("  assumed: activation gelu_new (config.json names no activation_function")
                   for line in lines), lines
        assert f"attention {attention}, dropout on, activation gelu_new, logits fp32, tied embeddings" in \
            next(line for line in lines if line.startswith("  model (")), lines
        peak = measured[(attention,) + chose[attention]]
        assert peak * 1.3 + 1.5 <= 143771 / 1024, (chose, peak)
        predicted = json.loads(run["files"]["memory.json"])["predicted"] / 2**30
        assert predicted <= peak < predicted * (1.01 if attention == "eager" else 1.05)
    assert chose == {"eager": ("zero1", 4), "sdpa": ("zero1", 8)}, chose
    assert any(line.startswith("  no room: zero1 micro-batch 16: predicted 127.2 GiB, wants 166.9 GiB")
               for line in lines), lines


def test_the_activation_is_read_from_an_hf_config_and_an_unknown_one_counted_as_the_costliest(tmp_path):
    values, notes = dsc_memory.hf_config_shape(dict(GPT2_CONFIG, activation_function="gelu_pytorch_tanh"))
    assert values["activation"] == "gelu_pytorch_tanh" and not any(n.startswith("activation ") for n in notes)
    assert dsc_memory.hf_config_shape({"model_type": "llama", "hidden_act": "silu"})[0]["activation"] == "silu"
    assert dsc_memory.hf_config_shape({"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"})[0][
        "activation"] == "gelu_pytorch_tanh"  # Gemma's MLP reads hidden_activation first
    values, notes = dsc_memory.hf_config_shape(dict(GPT2_CONFIG, activation_function="gelu_fancy"))
    assert values["activation"] == "gelu_fast" and any("'gelu_fancy', which the prediction does not know" in n
                                                        for n in notes)
    p, errors = auto_plan(143771, dict(users_code(tmp_path), dsc_model_shape={
        "layers": 2, "hidden": 64, "heads": 2, "vocab": 100, "seq_len": 64, "activation": "gelu_fancy"}))
    assert any("bad values for ['activation']" in e and "gelu_new" in e for e in errors), errors


def test_the_step_down_test_s_shape_gives_the_choice_it_is_built_on(tmp_path):
    """molecule/tests/test_auto_step_down.py's model on two CPU nodes with 16 GiB per rank: auto
    chooses zero3 at micro-batch 8 and steps down to 4, then 2 (its script fails above 4)."""
    shape = {"layers": 2, "hidden": 64, "heads": 2, "vocab": 512, "seq_len": 8192, "attention": "eager",
             "dropout": 0, "tied": True, "activation": "gelu"}
    opts = dict(users_code(tmp_path), dsc_model_shape=shape, dsc_train_batch=32, dsc_auto_memory_gib=16)
    p, errors = plan(options=opts, full_run=True)
    assert errors == [], errors
    lines = "\n".join(p["run"]["auto"])
    assert "preset=auto chose zero3 at micro-batch 8" in lines, lines
    assert "steps down to: zero3 micro-batch 4, then zero3 micro-batch 2" in lines, lines
