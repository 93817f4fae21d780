"""The plan's settings (dscplan.settings): the spec declares what the plan reads, undeclared and
retired names refused (inventory and -e), the shipped inventories, choices, pins, each bad value
refused with its variable, host and fix, control characters in any setting, each check's
whole-string match, secrets by name only, and Jinja in -e values as ansible-core would see it.

    .venv/bin/pytest tests/unit/test_plan_settings.py -q
"""
import itertools
import json

import pytest
import yaml

import dscplan
from tests.unit.plan_helpers import ROOT, OPTIONS, PINS, DEFAULTS, PATHS, cluster, plan


def test_spec_declares_exactly_what_the_plan_reads():
    assert set(DEFAULTS) == set(dscplan.CLUSTER_SETTINGS + dscplan.SECRET_SETTINGS + dscplan.NODE_SETTINGS
                                + dscplan.RUN_OPTIONS)


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
    ({"dsc_rank_env": {"DSC_RANK_WINDOW": "1.5"}}, "dsc_rank_env on host node1: DSC_RANK_WINDOW is '1.5'. Fix: the steps of each window"),
    ({"dsc_addr": "10.0.0.300"}, "dsc_addr on host node1 is '10.0.0.300', not an IPv4 address"),
    ({"dsc_addr": "10.0.0.11\nProxyCommand x"}, "dsc_addr on host node1"),
    ({"dsc_rank_env": {"MLFLOW_TRACKING_URI": "https://user:pw@mlflow.lab"}}, "holds a password in a URL"),
    ({"dsc_requirements": ["transformers>=>4"]}, "dsc_requirements on host node1: 'transformers>=>4' is not a requirement"),
    ({"dsc_requirements": ["--index-url http://x"]}, "is not a requirement"),
    ({"dsc_requirements": ["pkg @ https://example.org/pkg.whl"]}, "installs from a URL"),
    ({"dsc_requirements": ["torch==2.0"]}, "torch, DeepSpeed and py-spy are dsc_torch_version"),
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


def test_a_cluster_wide_setting_that_differs_names_the_nodes():
    hostvars, groups, probes = cluster(3)
    hostvars["node3"]["dsc_install_root"] = "/srv/ds"
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert any(e.startswith("dsc_install_root differs between nodes") and "node3" in e for e in errors), errors


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
EVERY_SETTING = [n for n in OPTIONS if n not in dscplan.JSON_ONLY + dscplan.SECRET_SETTINGS + dscplan.PLAYBOOK_INPUTS]


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
