"""The run: its id and directory, the run options, what a resume refuses, the entry and launcher
arguments, the secrets, and the commands the runs role runs."""
from __future__ import annotations

import json
import os
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path

from dscnode.rundir import SECRETS_DIR, RunDir
from dscnode.safe import SHELL_SAFE, latest_glob

from .auto import auto_preset, ladder_record, memory_record
from .deepspeed_config import run_sections, batch, compose_config, precision, presets, read_user_config
from .problems import as_bool, is_int
from .record import RunRecord
from .shrink import shrink_files
from .rendered import rendered_files, code_archive
from .vocabulary import JSON_ONLY, RUN_OPTIONS
from .paths import abs_path
from .hygiene import control_paths, templates_in

CONFIG_MODES = ("preset", "file", "hf", "none")
# How the ds_config reaches the script, per mode: DeepSpeed-style scripts take
# --deepspeed_config (deepspeed.add_config_arguments), HF Trainer scripts --deepspeed; "env" hands
# it to accelerate (ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_CONFIG_FILE), as `accelerate
# launch` would.
CONFIG_ARGS = {"preset": "--deepspeed_config", "file": "--deepspeed_config", "hf": "--deepspeed", "none": ""}
# What a run was launched with, written to its launch.json: resume.yml and restarts start exactly
# the same command (the user's entry point and arguments, the preset, the batch) from it.
LAUNCH_SPEC = (
    "preset", "dsc_micro_batch", "dsc_grad_accum", "dsc_train_batch", "dsc_ds_config_overrides",
    "dsc_code_dir", "dsc_code_shared", "dsc_entry_module", "dsc_entry_script", "dsc_entry_args",
    "dsc_train_config", "dsc_ds_config_mode", "dsc_ds_config_file", "dsc_ds_config_arg",
    "dsc_resume_args", "dsc_launcher_args", "dsc_min_nodes", "dsc_checkpoint_shared_dir",
)
# Run options that only a launch applies: they shape the files and code written into the run
# directory then (ds_config.json, train.json, .deepspeed_env, memory.json, code/), which a resume
# keeps as they are; resume refuses them given with -e. dsc_code_dir too, unless the code is on a
# shared filesystem (run from there, not copied). What a resume does apply: the entry point and
# its arguments, resume and launcher arguments, restarts, stall handling, follow, preflight.
LAUNCH_ONLY = (
    "preset", "dsc_micro_batch", "dsc_grad_accum", "dsc_train_batch", "dsc_ds_config_overrides",
    "dsc_ds_config_mode", "dsc_ds_config_file", "dsc_ds_config_arg", "dsc_tensorboard",
    "dsc_train_config", "dsc_model_shape", "dsc_auto_memory_gib", "dsc_code_shared", "dsc_min_nodes",
    "dsc_checkpoint_shared_dir",
)
# DeepSpeed launcher options a run may add (dsc_launcher_args): flag -> takes a value. The rest
# (hostfile, include, ports, node rank, ssh) are the plan's.
LAUNCHER_OPTIONS = {"--bind_cores_to_rank": False, "--bind_core_list": True, "--no_local_rank": False,
                    "--enable_each_rank_log": True}
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass
class Unplanned:
    """What the run's checks know of a cluster whose own settings failed (no Plan): where runs
    live. The run options are checked all the same, so that every problem comes at once."""
    run_root: str
    master: str
    world_size: None = None
    nodes: list = field(default_factory=list)
    secret_names: list = field(default_factory=list)


def _run_options(options, defaults, runs_seen, problems):
    """The run options: given ones, else the resumed run's launch spec, else the defaults."""
    opt = {k: options.get(k, defaults.get(k)) for k in RUN_OPTIONS}
    opt = {k: (defaults.get(k) if v is None else v) for k, v in opt.items()}
    if as_bool(opt["resume"]):  # the run's own launch spec: the same entry, arguments, preset and
        # batch, except what this command gives explicitly (-e), e.g. more steps; never what
        # only a launch applies (its files keep the run's own: _refused_on_resume)
        wanted = str(opt["run_id"] or "") or (runs_seen[0].id if runs_seen else "")
        spec = next((r.launch for r in runs_seen if r.id == wanted), None) or {}
        spec = {k: v for k, v in spec.items() if k in LAUNCH_SPEC}
        trained = next((r.trained for r in runs_seen if r.id == wanted), None) or {}
        if trained.get("step"):  # after a step down: what trains now
            spec.update(preset=trained.get("preset"), dsc_micro_batch=trained.get("micro_batch"))
        _recorded_spec_problems(spec, wanted, problems)
        opt.update({k: v for k, v in spec.items() if k not in options or k in LAUNCH_ONLY})
    return opt


def _recorded_spec_problems(spec, run_id, problems):
    """A resumed run's launch spec (its launch.json, read back from the master, where the training
    user can write it) is checked as if the operator had typed it: a control character or a
    Jinja template in a value is refused, as in an -e value; the rest of its checks are the run
    options' own. A resume reads no file of the control node that the record names (the
    ds_config file, the code: the run keeps its own)."""
    where = f"run {run_id!r}'s launch.json on the master"
    for var, value in spec.items():
        found = ([] if var in JSON_ONLY else control_paths(value, var)) + [(p, None) for p in templates_in(value, var)]
        for path, char in found:
            what = f"a control character ({char!r})" if char else "a Jinja template"
            problems.add(f"{path} in {where} holds {what}: the record a resume reads is checked as "
                         f"an -e value is. Fix: launch a new run (launch.yml), or mend the record "
                         f"and ask who wrote it (the run directory is the training user's).")


def _refused_on_resume(extra_vars, opt, run_id, problems):
    """On resume: the -e options only a launch applies (LAUNCH_ONLY; dsc_code_dir where the run's
    code was copied into it) are refused, naming them: the resume would ignore them."""
    given = [k for k in LAUNCH_ONLY if k in extra_vars]
    if "dsc_code_dir" in extra_vars and not as_bool(opt["dsc_code_shared"]):
        given.append("dsc_code_dir")
    if given:
        one = len(given) == 1
        problems.add(f"{', '.join(given)} given with -e on resume: a resume keeps the files and code "
                     f"run {run_id!r} was launched with (ds_config.json, train.json, .deepspeed_env, "
                     f"memory.json, code/), so {'it' if one else 'they'} would be ignored. Fix: launch a "
                     f"new run with {'this option' if one else 'these options'} (launch.yml), or resume "
                     f"without {'it' if one else 'them'}.")


def _run_id(opt, preset, plan, runs_seen, now, problems):
    """The run id: given, else (resume) the newest run, else <preset>-<UTC time>; checked."""
    run_id = str(opt["run_id"] or "")
    if not run_id and as_bool(opt["resume"]):
        run_id = runs_seen[0].id if runs_seen else ""
        if not run_id:
            problems.add(f"run_id: no run to resume under {plan.run_root} on "
                         f"{plan.master}. Fix: pass -e run_id=ID of an earlier run.")
    if not run_id:
        run_id = f"{preset}-{now}"
    if not RUN_ID.fullmatch(run_id) or run_id in (".", ".."):
        problems.add(f"run_id is {run_id!r}. Fix: 1-64 letters, digits, '.', '_' and '-', "
                     f"starting with a letter or digit (it names a directory on every node).")
    return run_id


def _arguments(value, var, example, problems, latest=False):
    """A list of command-line arguments in the charset DeepSpeed's pdsh runner passes safely
    (`latest`: a `{latest:GLOB}` argument too, which the node helper resolves inside the run's
    working directory: dscnode.safe)."""
    if not isinstance(value, list):
        problems.add(f"{var} is {value!r}. Fix: a list of arguments, e.g. {example}.")
        return []
    for arg in value:
        if latest and str(arg).startswith("{latest:"):
            if latest_glob(arg) is None:
                problems.add(f"{var} holds {str(arg)!r}. Fix: {{latest:GLOB}} with a glob relative to the "
                             f"run's working directory, without '..' or a leading '/', of letters, "
                             f"digits and '@%+=:,.*?/-_' (e.g. {{latest:out/checkpoint-*}}).")
        elif not SHELL_SAFE.fullmatch(str(arg)):
            problems.add(f"{var} holds {str(arg)!r}. Fix: letters, digits and '@%+=:,./-_' only "
                         f"(the pdsh launcher passes arguments through a shell on every node).")
    return [str(a) for a in value]


def _launcher_args(value, problems):
    """dsc_launcher_args: the DeepSpeed launcher options a run may add (LAUNCHER_OPTIONS)."""
    args = _arguments(value, "dsc_launcher_args", "['--bind_cores_to_rank']", problems)
    i = 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name not in LAUNCHER_OPTIONS:
            problems.add(f"dsc_launcher_args holds {args[i]!r}. Fix: one of "
                         f"{', '.join(LAUNCHER_OPTIONS)}; the hostfile, GPUs, ports and nodes "
                         f"come from the inventory.")
        elif LAUNCHER_OPTIONS[name] and "=" not in args[i]:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                problems.add(f"dsc_launcher_args: {name} needs a value. Fix: {name} VALUE.")
            i += 1
        i += 1
    return args


def _entry(opt, paths, problems):
    """What the launcher starts: a module or a script inside the code directory, its arguments."""
    module, script = str(opt["dsc_entry_module"] or ""), str(opt["dsc_entry_script"] or "")
    if script and (posixpath.isabs(script) or ".." in script.split("/")
                   or not re.fullmatch(r"[A-Za-z0-9._/-]+", script)):
        problems.add(f"dsc_entry_script is {script!r}. Fix: a path relative to dsc_code_dir, "
                     f"e.g. train.py or scripts/train.py.")
    if not script and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", module):
        problems.add(f"dsc_entry_module is {module!r}. Fix: a Python module name such as "
                     f"train.run, or set dsc_entry_script.")
    shared = as_bool(opt["dsc_code_shared"])
    code_dir = str(opt["dsc_code_dir"] or "") or str(Path(paths["repo"]) / "train")
    if shared:
        abs_path(problems, "dsc_code_dir", code_dir, "/shared/code", "(dsc_code_shared)",
                  "every rank runs the code in it, from it")
    elif not os.path.isdir(code_dir):
        problems.add(f"dsc_code_dir is {code_dir!r}, which is not a directory on the control "
                     f"node. Fix: the directory that holds your training code.")
    elif script and not os.path.isfile(os.path.join(code_dir, script)):
        problems.add(f"dsc_entry_script is {script!r}, which is not in dsc_code_dir "
                     f"({code_dir}). Fix: a path relative to that directory.")
    return {"module": module, "script": script, "code_dir": code_dir, "shared": shared,
            "launcher_args": _launcher_args(opt["dsc_launcher_args"], problems),
            "args": _arguments(opt["dsc_entry_args"], "dsc_entry_args", "['--set', 'steps=100']", problems),
            "resume_args": _arguments(opt["dsc_resume_args"], "dsc_resume_args",
                                      "['--resume'], ['--resume_from_checkpoint', "
                                      "'{latest:out/checkpoint-*}'], or [] for a script that resumes "
                                      "from its own output dir", problems, latest=True)}


def _config_choice(opt, problems, read=True):
    """(mode, how the file reaches the script, the user's ds_config or None: not `read` on a
    resume, which keeps the run's own ds_config.json)."""
    mode = str(opt["dsc_ds_config_mode"])
    if mode not in CONFIG_MODES:
        problems.add(f"dsc_ds_config_mode is {mode!r}. Fix: one of {', '.join(CONFIG_MODES)} "
                     f"(preset: the toolkit's; file: your ds_config.json; hf: HF Trainer or "
                     f"accelerate, 'auto' values kept; none: the script configures DeepSpeed).")
        mode = "preset"
    config_arg = str(opt["dsc_ds_config_arg"] or "") or CONFIG_ARGS[mode]
    if config_arg not in ("--deepspeed_config", "--deepspeed", "env", "none", ""):
        problems.add(f"dsc_ds_config_arg is {config_arg!r}. Fix: --deepspeed_config "
                     f"(DeepSpeed-style scripts), --deepspeed (HF Trainer), env (accelerate: "
                     f"ACCELERATE_DEEPSPEED_CONFIG_FILE) or none.")
    config_arg = "" if config_arg == "none" or mode == "none" else config_arg
    user_file, user_config = str(opt["dsc_ds_config_file"] or ""), None
    if mode == "file" and not user_file:
        problems.add("dsc_ds_config_file is empty but dsc_ds_config_mode is 'file'. Fix: the path "
                     "of your ds_config.json on the control node.")
    elif mode in ("file", "hf") and user_file and read:
        user_config = read_user_config(user_file, problems)
    return mode, config_arg, user_config


def _refused_starts(opt, run_id, plan, runs_seen, refuse_active, queues, problems, new_end=None):
    """An active run (unless replace), a resume of an unknown run, a new run in a used directory,
    a finished run resumed without force or a new end (`new_end`: steps=N's)."""
    seen = {r.id: r for r in runs_seen}
    this = seen.get(run_id)
    active = [r.id for r in runs_seen if r.active]
    for node in plan.nodes or []:
        if run_id in node.run_root_links:
            problems.add(f"run_id {run_id!r}: {plan.run_root}/{run_id} on {node.name} is a "
                         f"symbolic link, not a run directory (a run's files would be written "
                         f"wherever it points). Fix: remove the link (check who planted it), or "
                         f"launch with another run_id.")
    # Where a batch queue holds runs, a second run queues behind the first (the nodes are the
    # job's alone).
    if refuse_active and active and active[0] != run_id and not as_bool(opt["replace"]) \
            and not as_bool(opt["dry_run"]) and not queues:
        problems.add(f"run {active[0]} is active on {plan.master}. Fix: stop it "
                     f"(ansible-playbook stop.yml -e run_id={active[0]}), or launch with "
                     f"-e replace=true to stop and replace it.")
    if as_bool(opt["resume"]) and run_id not in seen and run_id:
        problems.add(f"run_id {run_id!r}: no such run under {plan.run_root} on "
                     f"{plan.master} to resume. Fix: the id of an earlier run "
                     f"({', '.join(list(seen)[:5]) or 'none there'}).")
    elif as_bool(opt["resume"]) and (this and this.active):
        problems.add(f"run_id {run_id!r} is still running on {plan.master}: resuming it would "
                     f"start a second copy. Fix: follow it (status.yml -e run_id={run_id} "
                     f"-e follow=true), or stop it first (stop.yml -e run_id={run_id}).")
    elif as_bool(opt["resume"]) and (this and this.finished) and not (as_bool(opt["force"]) or new_end):
        problems.add(f"run_id {run_id!r} finished on {plan.master}; resuming it would train "
                     f"past its end and rewrite its summary. Fix: -e steps=N to train it on to "
                     f"step N (the default job), -e force=true with your script's own new end in "
                     f"dsc_entry_args, or launch a new run.")
    elif not as_bool(opt["resume"]) and (this and this.started):
        problems.add(f"run_id {run_id!r}: {plan.run_root}/{run_id} already holds a run (its "
                     f"metrics and checkpoints would mix with a new run's). Fix: resume it "
                     f"(ansible-playbook resume.yml -e run_id={run_id}) or launch with another "
                     f"run_id.")


def secrets_path(run_root, run_id):
    """Where the node helper keeps a run's secrets (dscnode.rundir.secrets_file): beside the run."""
    return f"{run_root}/{SECRETS_DIR}/{run_id}.json"


def _resume_secrets(run_id, plan, runs_seen, problems):
    """On resume: whether the ranks load the run's secrets (DSC_SECRETS). Given again
    (dsc_secrets), they are written anew and must name every secret the run was launched with;
    not given, the run's own file (0600, beside it) is used, on every node, or resume refuses,
    naming the secrets: ranks never start without them silently. A run launched without any
    refuses them: its kept .deepspeed_env does not tell the ranks to load secrets."""
    run = next((r for r in runs_seen if r.id == run_id), None)
    if run is None or isinstance(plan, Unplanned):
        return False
    names = (run.launch or {}).get("secret_names") or []
    recorded = sorted(map(str, names)) if isinstance(names, list) else []
    given = plan.secret_names or []
    if given and not recorded:
        problems.add(f"dsc_secrets: run {run_id!r} was launched without secrets, and a resume keeps "
                     f"the run's files, the ranks' environment (.deepspeed_env, which DeepSpeed's "
                     f"runner passes to every node) among them: its ranks would start without "
                     f"{', '.join(given)}. Fix: launch a new run with them (launch.yml), or "
                     f"resume without dsc_secrets.")
        return False
    if given:
        missing = [n for n in recorded if n not in given]
        if missing:
            problems.add(f"dsc_secrets: run {run_id!r} was launched with {', '.join(recorded)}; this "
                         f"resume gives {', '.join(given)} and leaves out {', '.join(missing)}, "
                         f"which its ranks would start without. Fix: give every one of them (the "
                         f"resume writes the run's secrets anew), or none: the run's own are used.")
        return True
    having = [n.name for n in plan.nodes if run_id in n.runs_with_secrets]
    if not recorded and not having:
        return False
    lacking = [n.name for n in plan.nodes if n.reachable and n.name not in having]
    if lacking:
        names = ", ".join(recorded) or "secrets"
        problems.add(f"dsc_secrets: run {run_id!r} was launched with {names}, and its secrets file "
                     f"({secrets_path(plan.run_root, run_id)}) is gone on {', '.join(lacking)}: "
                     f"its ranks would start without {'them' if recorded else 'theirs'}. Fix: give "
                     f"dsc_secrets again ({names}: the vault file, or -e @file); the resume "
                     f"writes them anew on every node.")
    return True


def _commands(plan, launcher, run_dir, entry, config_arg, resume):
    """{node: the DeepSpeed launcher's argv} on each node that starts one (the launch mode's
    choice). Each rank runs the node helper's entry shim (secrets, progress), which runs the
    user's script or module in the same process."""
    runner = [posixpath.dirname(plan.python) + "/deepspeed",
                "--hostfile", f"{run_dir}/{RunDir.HOSTFILE}", "--master_addr", plan.master_addr]
    if len(plan.ssh_ports) == 1 and plan.ssh_ports[0] != 22:
        runner += ["--ssh_port", str(plan.ssh_ports[0])]
    if plan.num_nodes == 1:
        runner += ["--no_ssh_check"]
    if any(n.gpu_ids for n in plan.nodes):  # DeepSpeed's NAME:SLOT[,SLOT]@NAME...
        runner += ["--include", "@".join(
            f"{n.name}:{','.join(map(str, n.used_gpus))}" for n in plan.nodes)]
    runner += entry["launcher_args"]
    train_run = entry["module"] == "train.run" and not entry["script"]
    program = [plan.helper, "entry"] \
        + (["--script", entry["script"]] if entry["script"] else ["--module", entry["module"]]) \
        + ([config_arg, f"{run_dir}/{RunDir.DS_CONFIG}"] if config_arg.startswith("--") else []) \
        + (["--config", f"{run_dir}/{RunDir.TRAIN_CONFIG}"] if train_run else []) \
        + entry["args"] + (entry["resume_args"] if resume else [])
    return launcher.commands(plan.nodes, plan.master, runner, program)


def _new_end(opt, entry, problems):
    """resume's steps=N for the default job: the run's train config with its end moved to N (the
    rest of its configuration kept), or None where steps is not given (0). Refused on a launch
    (dsc_train_config's steps is the end there) and for a script, whose end is its own argument."""
    steps = opt["steps"]
    if steps in (None, "", 0, "0"):
        return None
    if not is_int(steps) or int(steps) < 1:
        problems.add(f"steps is {steps!r}. Fix: the step to train the run on to, a whole number above 0.")
        return None
    steps = int(steps)  # -e gives it as a string
    if not as_bool(opt["resume"]):
        problems.add(f"steps={steps} given to a launch: it moves a resumed run's end. Fix: "
                     f"dsc_train_config's steps for a new run (-e '{{\"dsc_train_config\": "
                     f"{{\"steps\": {steps}}}}}'), or resume.yml -e steps={steps}.")
    elif entry["script"] or entry["module"] != "train.run":
        problems.add(f"steps={steps}: the run's entry is {entry['script'] or entry['module']}, whose end "
                     f"is its own argument (the toolkit moves only the default job's). Fix: give it in "
                     f"dsc_entry_args (e.g. ['--max_steps', '{steps}'] for HF's Trainer) with -e force=true "
                     f"where the run finished.")
    else:
        return dict(opt["dsc_train_config"] or {}, steps=steps)
    return None


def _moved_end(run_id, runs_seen, new_end, files):
    """The files that hold a resumed run's end, steps=N's: train.json (this plan's, the run's own
    train config with the new end) and launch.json as the run recorded it (its secrets' names and
    all) but for that train config."""
    recorded = next((r.launch for r in runs_seen if r.id == run_id), None) or {}
    return {RunDir.TRAIN_CONFIG: files[RunDir.TRAIN_CONFIG],
            RunDir.LAUNCH: json.dumps(dict(recorded, dsc_train_config=new_end), indent=2, sort_keys=True) + "\n"}


def _check_restarts(opt, launcher, problems):
    """The supervisor's options: whole numbers, and what the launch mode cannot honour."""
    for var in ("max_restarts", "restart_backoff_s", "dsc_stall_timeout_s"):
        if not is_int(opt[var]) or int(opt[var]) < 0:
            problems.add(f"{var} is {opt[var]!r}. Fix: a whole number, 0 or more.")
    launcher.option_problems(opt, problems)


def _ds_config_overrides(opt, problems):
    """dsc_ds_config_overrides, or {} (with a problem) where it is not a mapping."""
    overrides = opt["dsc_ds_config_overrides"] or {}
    if not isinstance(overrides, dict):
        problems.add(f"dsc_ds_config_overrides is {overrides!r}. Fix: a mapping of DeepSpeed "
                     f"config keys, e.g. {{zero_optimization: {{stage: 1}}}}.")
        overrides = {}
    return overrides


def _run_env(plan, run_id, run_dir, secrets, config_arg):
    """The ranks' environment: the cluster's, the run's id and directory, and accelerate's own
    variables where the config goes to it through the environment."""
    env = dict(plan.rank_env, DSC_RUN_ID=run_id, DSC_RUN_DIR=run_dir)
    if secrets:  # the run's own, kept beside it (the supervisor's restarts keep this env)
        env["DSC_SECRETS"] = "1"
    if config_arg == "env":  # accelerate's own variables, as `accelerate launch` sets them; its
        # "auto" precision follows ACCELERATE_MIXED_PRECISION: the hardware's, as for presets
        dtype = precision(plan.accelerator, [c for n in plan.nodes for c in n.compute_caps])
        env.update(ACCELERATE_USE_DEEPSPEED="true",
                   ACCELERATE_DEEPSPEED_CONFIG_FILE=f"{run_dir}/{RunDir.DS_CONFIG}",
                   ACCELERATE_MIXED_PRECISION="bf16" if dtype["bf16"]["enabled"]
                   else "fp16" if dtype["fp16"]["enabled"] else "no")
    return env


def _run_files(opt, plan, run_id, config, hostfile, memory, step_down, env_text):
    """The files written into the run directory on every node (name -> text)."""
    return {
        **({RunDir.DS_CONFIG: json.dumps(config, indent=2, sort_keys=True) + "\n"} if config else {}),
        RunDir.HOSTFILE: hostfile,
        RunDir.TRAIN_CONFIG: json.dumps(opt["dsc_train_config"] or {}, indent=2, sort_keys=True) + "\n",
        # the predicted peak per GPU, beside which each rank records its measured one
        **({RunDir.MEMORY: json.dumps(memory, indent=2, sort_keys=True) + "\n"} if memory else {}),
        # preset=auto's step-down ladder (the node helper's supervisor reads it) and each later
        # step's ds_config (the supervisor's attempts take that step's file after a step down)
        **(_ladder_files(step_down) if step_down else {}),
        RunDir.RUN_ID: run_id + "\n",
        # with the names (never the values) of its secrets: resume checks they are there
        RunDir.LAUNCH: json.dumps(dict({k: opt[k] for k in LAUNCH_SPEC},
                                       secret_names=plan.secret_names),
                                  indent=2, sort_keys=True) + "\n",
        RunDir.DS_ENV: env_text,
    }


def _shared_checkpoints(opt, entry, run_id, resume, problems):
    """dsc_checkpoint_shared_dir: the directory on a filesystem every node mounts where the run's
    checkpoints go, one copy of each that any node reads ("": node-local checkpoints, each node's
    part kept on another node too). train.run saves to <it>/<run id> unless dsc_train_config names
    its checkpoint_dir (set in opt: launch.json keeps it for resume); a script saves where its own
    arguments say. The runs role checks that every node sees the same directory before a start."""
    shared = str(opt["dsc_checkpoint_shared_dir"] or "")
    if not shared or not abs_path(problems, "dsc_checkpoint_shared_dir", shared, "/shared/checkpoints",
                                  "(where every node saves its checkpoints)", "the training user writes there"):
        return ""
    train = opt["dsc_train_config"]
    if not resume and not entry["script"] and entry["module"] == "train.run" and isinstance(train, dict) \
            and not train.get("checkpoint_dir"):
        opt["dsc_train_config"] = dict(train, checkpoint_dir=f"{shared.rstrip('/')}/{run_id}")
    return shared


def _ladder_files(step_down):
    """auto.json (the ladder: each step's preset, batch and predicted peak) and the ds_config of
    every step after the first (the first's is ds_config.json), written once, at launch."""
    ladder = [{k: v for k, v in step.items() if k != "ds_config"} for step in step_down["ladder"]]
    return {RunDir.AUTO: json.dumps(dict(step_down, ladder=ladder), sort_keys=True) + "\n",
            **{RunDir.step_config(i): json.dumps(step["ds_config"], indent=2, sort_keys=True) + "\n"
               for i, step in enumerate(step_down["ladder"]) if i}}


def _preset(plan, s, opt, options, paths, entry, resume, problems):
    """(preset, options, auto's reasons, its step-down ladder, the model's shape): -e preset, or
    preset=auto's choice (kept in opt and options: launch.json keeps it, so resume and restarts
    take the same preset and batch)."""
    preset = str(opt["preset"])
    if preset == "auto" and not resume and plan.world_size is not None:
        chosen, micro_batch, auto, ladder, model = auto_preset(plan, opt, options, paths, entry, problems, s)
        if chosen:
            preset = opt["preset"] = chosen
            opt["dsc_micro_batch"] = micro_batch
            options = dict(options, dsc_micro_batch=micro_batch)
        return preset, options, auto, ladder, model
    known = presets(paths["templates"])
    if preset not in known:
        problems.add(f"preset is {preset!r}. Fix: one of {', '.join(known)} (or add "
                     f"templates/ds_config/{preset}.json).")
    return preset, options, [], [], None


def plan_run(plan, s, launcher, options, defaults, paths, problems, runs_seen, now, refuse_active=True, extra_vars=()):
    """The run's part of the plan: id, directory, ds_config, files and the launcher command.
    `launcher`: the launch mode's (launchers.Launcher); `extra_vars`: the names given with -e (a resume refuses
    the LAUNCH_ONLY ones)."""
    opt = _run_options(options, defaults, runs_seen, problems)
    resume = as_bool(opt["resume"])
    entry = _entry(opt, paths, problems)
    new_end = _new_end(opt, entry, problems)
    if new_end:  # written again into the run (train.json, launch.json) by this resume
        opt["dsc_train_config"] = new_end
    preset, options, auto, ladder, model = _preset(plan, s, opt, options, paths, entry, resume, problems)
    run_id = _run_id(opt, preset, plan, runs_seen, now, problems)
    if resume:
        _refused_on_resume(extra_vars, opt, run_id, problems)
    shared_dir = _shared_checkpoints(opt, entry, run_id, resume, problems)
    _check_restarts(opt, launcher, problems)
    overrides = _ds_config_overrides(opt, problems)
    mode, config_arg, user_config = _config_choice(opt, problems, read=not resume)
    sizes = {}
    if plan.world_size is not None:  # None: the nodes' own problems come first
        sizes = batch(opt["dsc_micro_batch"], opt["dsc_grad_accum"], opt["dsc_train_batch"],
                      plan.world_size)
        # The toolkit's batch applies to presets, and to a user's config only where given (-e).
        if "error" in sizes and (mode == "preset" or any(
                k in options for k in ("dsc_micro_batch", "dsc_grad_accum", "dsc_train_batch"))):
            problems.add(sizes["error"])
    _refused_starts(opt, run_id, plan, runs_seen, refuse_active, launcher.queues, problems, new_end)
    secrets = resume and _resume_secrets(run_id, plan, runs_seen, problems)
    archive = ""
    if not entry["shared"] and not resume and os.path.isdir(entry["code_dir"]):
        try:
            archive = code_archive(entry["code_dir"])
        except ValueError as e:
            problems.add(str(e))
    if problems.messages:
        return None
    run_dir = f"{plan.run_root}/{run_id}"
    # A resume keeps the run's own ds_config.json (written at its launch): none is composed.
    config = None if resume else compose_config(
        mode, paths["templates"], preset, set(options), plan.accelerator,
        [c for n in plan.nodes for c in n.compute_caps], sizes, overrides, user_config,
        plan.world_size, problems)
    # The code lands in <run_dir>/code; a package entry (train.run from train/) keeps its folder
    # name so that `python -m train.run` finds it.
    code_base = os.path.basename(os.path.normpath(entry["code_dir"]))
    package_dir = not entry["script"] and entry["module"].split(".")[0] == code_base
    if as_bool(opt["dsc_tensorboard"]) and config is None:
        problems.add("dsc_tensorboard is true but dsc_ds_config_mode is 'none'. Fix: enable "
                     "DeepSpeed's tensorboard section in the config your script passes, or "
                     "use a mode the toolkit writes the config for.")
    if config is not None:
        run_sections(config, run_dir, as_bool(opt["dsc_tensorboard"]), node_local=not shared_dir)
        if shared_dir and config["checkpoint"]["use_node_local_storage"]:
            problems.add(f"dsc_checkpoint_shared_dir is {shared_dir!r} and the run's ds_config sets "
                         f"checkpoint.use_node_local_storage true (each node would save the shared state "
                         f"into the one directory). Fix: drop that key, or dsc_checkpoint_shared_dir.")
    memory = memory_record(plan, opt, entry, s, config, model, resume)
    step_down = ladder_record(plan, launcher.step_down_why(plan.num_nodes or 0), opt, options, paths, mode,
                           ladder, overrides, user_config, run_dir, auto, node_local=not shared_dir)
    env = _run_env(plan, run_id, run_dir, secrets, config_arg)
    hostfile, env_text = rendered_files(paths, plan, env, problems)
    commands = _commands(plan, launcher, run_dir, entry, config_arg, resume)
    start_args = launcher.start_args(plan.nodes, commands, opt, plan.run_root, plan.py_spy, entry["resume_args"])
    workdir = entry["code_dir"] if entry["shared"] else f"{run_dir}/{RunDir.CODE}"
    # the run's {latest:GLOB}s: in its command (a resume's), and in what a restart adds
    started = list(dict.fromkeys(g for c in commands.values() for a in c if (g := latest_glob(a))))
    globs = list(dict.fromkeys(started + [g for a in entry["resume_args"] if (g := latest_glob(a))]))
    launch_files = launcher.files(plan, run_id, run_dir, workdir, commands, start_args, env,
                                  (int(opt["max_restarts"]), int(opt["restart_backoff_s"])), globs)
    files = dict(_run_files(opt, plan, run_id, config, hostfile, memory, step_down, env_text), **launch_files,
                 **(shrink_files(opt, plan, launcher, config, step_down, problems) if not resume else {}))
    return RunRecord(
        id=run_id, dir=run_dir, preset=preset, resume=resume, auto=auto,
        dry_run=as_bool(opt["dry_run"]), follow=as_bool(opt["follow"]), preflight=as_bool(opt["preflight"]),
        max_restarts=int(opt["max_restarts"]), batch=sizes, ds_config=config, config_mode=mode,
        ds_config_file=str(opt["dsc_ds_config_file"] or ""),
        code_dir=entry["code_dir"], code_shared=entry["shared"],
        code_dest=f"{run_dir}/{RunDir.CODE}" + (f"/{code_base}" if package_dir else ""),
        workdir=workdir, env=env, secrets_file=secrets_path(plan.run_root, run_id),
        commands=commands, start_args=start_args, code_archive=archive, files=files,
        checkpoint_shared_dir=shared_dir,
        latest_globs=started if launcher.agrees_latest == "ansible" else [],
        # A resume keeps the run's files, but the launch mode's (its commands carry the resume)
        # and, with steps=N, those that hold the run's end, for this attempt and every later one.
        resume_files=dict(launch_files, **(_moved_end(run_id, runs_seen, new_end, files) if new_end else {})),
        # the run files the roles name: the ranks' environment file (DeepSpeed's runner reads
        # DS_ENV_FILE), the launcher's log (the launch message) and train.allreduce's result
        # (preflight.yml reads it on the master)
        ds_env_file=f"{run_dir}/{RunDir.DS_ENV}", log=f"{run_dir}/{RunDir.LOG}",
        allreduce_result=f"{run_dir}/{RunDir.ALLREDUCE}",
    )


def run_reference(run_id, runs, run_root):
    """The run that status, stop and logs act on: run_id if given, else the active run, else
    none (those playbooks then refuse and list the runs: the newest directory is not
    necessarily the run going on, and a stop of the wrong one would report "none left" while
    the real one trains); (id, dir, problem)."""
    if run_id:
        if not RUN_ID.fullmatch(run_id) or run_id in (".", ".."):
            return None, None, (f"run_id is {run_id!r}. Fix: 1-64 letters, digits, '.', '_' and "
                                f"'-', starting with a letter or digit.")
    else:
        run_id = next((r.id for r in runs if r.active), "")
    return (run_id or None), (f"{run_root}/{run_id}" if run_id else None), None


def plot_runs(given, run_id, plan, problems):
    """The runs plot.yml draws: those given (each a run on the master), else the run (run_id)."""
    if not isinstance(given, list):
        problems.add(f"plot_runs is {given!r}. Fix: a list of run ids, e.g. [\"zero2-a\", \"zero3-b\"].")
        return []
    known = [r.id for r in plan.runs]
    for wanted in map(str, given):
        if wanted not in known:
            problems.add(f"plot_runs: no run {wanted!r} under {plan.run_root} on {plan.master}. "
                         f"Fix: one of {', '.join(known[:8]) or 'none there yet'} (runs.yml lists them).")
    newest = [run_id] if run_id else known[:1]
    return [str(r) for r in given] or newest
