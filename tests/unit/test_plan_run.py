"""The run as the plan makes it (dscplan.run): its id and directory, the launcher command (pdsh,
no_ssh, one node, a user's script through the entry shim, launcher options, the accelerate
variables), which run status/stop act on, an active run, resume (its refusals, the options it
applies, the run's own launch spec and secrets), {latest:...} and plot_runs.

    .venv/bin/pytest tests/unit/test_plan_run.py -q
"""
import json

import pytest

import dscplan
from dscnode.rundir import secrets_file
from tests.unit.plan_helpers import ROOT, DEFAULTS, PATHS, cluster, plan


@pytest.mark.parametrize("run_id", ["../x", "/etc", "a b", "a;b", "$(id)", "x\ny", "{{ 7*7 }}", ".", "-rf", "a" * 65])
def test_hostile_run_ids_are_refused(run_id):
    p, errors = plan(options={"run_id": run_id}, full_run=True)
    assert p is None and any(e.startswith("run_id is") for e in errors), errors


@pytest.mark.parametrize("arg", ["a;b", "$(touch /x)", "`id`", "a b", "x\ny", "'q'", '"q"'])
def test_entry_args_with_shell_characters_are_refused(arg):
    p, errors = plan(options={"dsc_entry_args": ["--set", arg]}, full_run=True)
    assert p is None and any("dsc_entry_args holds" in e for e in errors)


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


def test_latest_checkpoint_placeholder_only_in_resume_args():
    p, errors = plan(options={"dsc_resume_args": ["--resume_from_checkpoint", "{latest:out/checkpoint-*}"]},
                     full_run=True)
    args = p["run"]["start_args"]["node1"]
    assert errors == [] and json.loads(args[args.index("--resume-args") + 1])[-1] == "{latest:out/checkpoint-*}"
    p, errors = plan(options={"dsc_entry_args": ["{latest:out/checkpoint-*}"]}, full_run=True)
    assert any("dsc_entry_args holds '{latest:out/checkpoint-*}'" in e for e in errors), errors
    p, errors = plan(options={"dsc_resume_args": ["{latest:$(id)}"]}, full_run=True)
    assert any("dsc_resume_args holds '{latest:$(id)}'" in e for e in errors), errors
    # relative globs inside the run's working directory only
    for outside in ("{latest:../../*}", "{latest:/etc/*}", "{latest:out/../../x*}"):
        p, errors = plan(options={"dsc_resume_args": ["--resume_from_checkpoint", outside]}, full_run=True)
        assert any(f"dsc_resume_args holds '{outside}'. Fix: {{latest:GLOB}} with a glob relative" in e
                   for e in errors), errors


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


ACTIVE = [{"id": "old", "mtime": 2, "started": True, "active": True},
          {"id": "older", "mtime": 1, "started": True, "active": False}]


def test_an_active_run_refuses_a_second_launch_unless_replace():
    p, errors = plan(options={}, full_run=True, runs=ACTIVE)
    assert any("run old is active on node1" in e and "replace=true" in e for e in errors)
    p, errors = plan(options={"replace": True}, full_run=True, runs=ACTIVE)
    assert errors == [] and "--replace" in p["run"]["start_args"]["node1"]


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


def test_steps_trains_a_finished_run_on_to_a_new_end_with_its_own_configuration():
    """resume.yml -e steps=N: the default job's train.json and launch.json written again with the
    new end, the rest of its configuration kept; no force needed. A launch, a script's entry and a
    step that is no whole number are refused, naming the fix."""
    own = {"size": "tiny", "steps": 40, "lr": 0.003}
    done = [{"id": "r1", "mtime": 1, "started": True, "active": False, "finished": True, "secrets": True,
             "launch": {"preset": "zero2", "dsc_train_config": own, "dsc_entry_module": "train.run",
                        "secret_names": ["HF_TOKEN"]}}]
    hostvars, groups, probes = cluster(2, runs=done)
    probes["node2"]["runs"] = done  # its secrets file on every node
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {"steps": "60", "resume": True},
                                  now="20261130-000000", full_run=True, extra_vars={"steps"})  # as -e steps=60 gives it
    assert errors == [], errors
    files = p["run"]["resume_files"]
    assert json.loads(files["train.json"]) == dict(own, steps=60)
    # launch.json as the run recorded it (its secrets' names kept), but for its new end
    assert json.loads(files["launch.json"]) == dict(done[0]["launch"], dsc_train_config=dict(own, steps=60))
    assert "hostfile" not in files  # the run's other files stay as they are
    script = [dict(done[0], launch=dict(done[0]["launch"], dsc_entry_module="", dsc_entry_script="cifar10_deepspeed.py",
                                        dsc_code_dir=str(ROOT / "tests/fixtures/scripts/cifar")))]
    _, errors = resume_with_e({"steps": 60}, runs=script)
    assert any(e.startswith("steps=60: the run's entry is cifar10_deepspeed.py, whose end is its own argument") for e in errors), errors
    _, errors = plan(options={"steps": 60}, full_run=True)
    assert any(e.startswith("steps=60 given to a launch: it moves a resumed run's end.") for e in errors), errors
    for bad in (-5, "6o", True):
        _, errors = resume_with_e({"steps": bad}, runs=done)
        assert any(e.startswith(f"steps is {bad!r}. Fix:") for e in errors), (bad, errors)


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
              "dsc_code_shared": True, "dsc_code_dir": str(ROOT / "train"), "dsc_min_nodes": 1,
              "dsc_checkpoint_shared_dir": "/shared/ckpt"}
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


@pytest.mark.parametrize("mode", ["pdsh", "no_ssh"])
def test_no_ssh_nodes_are_asked_for_each_latest_glob_of_a_resume_before_they_start(tmp_path, mode):
    """Where every node starts its own launcher (no_ssh), the runs role asks each for its matches
    of the {latest:GLOB}s the resume's command holds (latest_globs); pdsh's supervisor asks them
    itself, and a launch holds none."""
    (tmp_path / "train.py").write_text("")
    opts = {"dsc_code_dir": str(tmp_path), "dsc_entry_script": "train.py",
            "dsc_resume_args": ["--resume_from_checkpoint", "{latest:out/checkpoint-*}"]}
    first, errors = plan(n=2, options=opts, full_run=True, dsc_launch_mode=mode)
    assert errors == [] and first["run"]["latest_globs"] == []
    runs = [{"id": first["run"]["id"], "mtime": 1, "started": True, "active": False,
             "launch": json.loads(first["run"]["files"]["launch.json"])}]
    again, errors = plan(n=2, options={"resume": True}, full_run=True, runs=runs, dsc_launch_mode=mode)
    assert errors == [] and again["run"]["commands"]["node1"][-1] == "{latest:out/checkpoint-*}"
    assert again["run"]["latest_globs"] == (["out/checkpoint-*"] if mode == "no_ssh" else [])


def test_resume_checks_the_runs_launch_record_as_typed_and_reads_no_file_it_names(tmp_path):
    """launch.json is read back from the master, where the training user writes: a Jinja template
    or a control character in it is refused as in an -e value, and the ds_config file it names on
    the control node is not read (the run keeps its own ds_config.json)."""
    secret = tmp_path / "operators-file.json"
    secret.write_text("not json: the plan must not read it")
    spec = {"preset": "zero2", "dsc_ds_config_mode": "file", "dsc_ds_config_file": str(secret)}
    runs = [{"id": "r1", "mtime": 1, "started": True, "active": False, "launch": spec}]
    p, errors = plan(options={"resume": True, "run_id": "r1"}, full_run=True, runs=runs)
    assert errors == [] and p["run"]["ds_config"] is None, errors
    for forged, needle in (({"dsc_entry_args": ["{{ lookup('pipe', 'id') }}"]}, "dsc_entry_args[0] in run 'r1'"),
                           ({"dsc_entry_module": "train.run\n"}, "dsc_entry_module in run 'r1'")):
        runs = [{"id": "r1", "mtime": 1, "started": True, "active": False, "launch": dict(spec, **forged)}]
        p, errors = plan(options={"resume": True, "run_id": "r1"}, full_run=True, runs=runs)
        assert p is None and any(needle in e and "launch.json on the master holds" in e and "Fix:" in e
                                 for e in errors), errors


def test_run_files_of_another_shape_fail_no_plan_stop_and_resume_included():
    """The probe's view of a run comes from files its training user writes: launch.json rewritten
    as a list, trained_with as a string, secret names as one string, a run without a name. No plan
    fails on them (stop.yml's must stop the run whatever they hold): each is taken as absent."""
    runs = [{"id": "r1", "mtime": "yesterday", "started": 1, "active": False, "launch": [1], "trained": "zero3"},
            {"id": 7, "mtime": 1}]
    p, errors = plan(options={"run_id": "r1"}, runs=runs)  # as stop.yml and status.yml plan
    assert errors == [] and [(r["id"], r["mtime"], r["started"], r["launch"]) for r in p["runs"]] == [("r1", 0.0, False, None)]
    p, errors = plan(options={"resume": True, "run_id": "r1"}, full_run=True, runs=runs)
    assert errors == [] and p["run"]["id"] == "r1", errors  # resumed with the run's own files, as they are
    runs = [{"id": "r1", "mtime": 1, "started": True, "active": False, "launch": {"secret_names": "HF_TOKEN"}}]
    p, errors = plan(options={"resume": True, "run_id": "r1"}, full_run=True, runs=runs, dsc_secrets={"HF_TOKEN": "x"})
    assert p is None and any("was launched without secrets" in e for e in errors), errors


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
    given again without one of them, or given to a run launched without any, resume refuses
    naming the secrets, before any change."""
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
    # ... and none to give it on resume: its kept .deepspeed_env would not have its ranks load them
    for hv in hostvars.values():
        hv["dsc_secrets"] = {"HF_TOKEN": "x"}
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {"resume": True}, full_run=True)
    assert p is None and any("dsc_secrets: run 'r1' was launched without secrets" in e
                             and "would start without HF_TOKEN" in e and "Fix: launch a new run with them" in e
                             for e in errors), errors


def test_a_launch_records_its_secret_names_never_their_values():
    p, errors = plan(dsc_secrets={"WANDB_API_KEY": "wandb-secret"}, full_run=True)
    spec = json.loads(p["run"]["files"]["launch.json"])
    assert spec["secret_names"] == ["WANDB_API_KEY"] and "wandb-secret" not in json.dumps(p)


def test_the_plans_secrets_path_is_the_node_helpers():
    assert str(secrets_file("/opt/dscluster/runs/r1")) == dscplan.secrets_path("/opt/dscluster/runs", "r1")


@pytest.mark.parametrize("value", ["../5", "5;id", "$(id)", "5\n", "#jinja2:variable_start_string:'[['\n[[ 7*7 ]]", "{{ 7*7 }}"])
def test_a_hostile_steps_is_refused_naming_it(value):
    """resume.yml -e steps=...: anything but a whole number is refused before any node changes."""
    done = [{"id": "r1", "mtime": 1, "started": True, "active": False, "finished": True,
             "launch": {"preset": "zero2", "dsc_train_config": {"steps": 40}, "dsc_entry_module": "train.run"}}]
    p, errors = resume_with_e({"steps": value}, runs=done)
    assert p is None and any(e.startswith("steps ") and "Fix:" in e for e in errors), errors
