"""What a run has recorded, read on a node: its state (status; with every node's through pdsh),
the runs under the run root and their table, the logged steps, the log's tail and first error,
the predicted and measured memory, preset=auto's steps down, the JIT op builds its ranks wait
on, and the run's files (logs.yml)."""
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

from dscnode import nccllog, program
from dscnode.procs import pid_alive, procs, ranks_of, started_by
from dscnode.rundir import (
    HISTORY_LIMIT,
    LINES_LIMIT,
    RunDir,
    entries,
    has_secrets,
    last_lines,
    json_objects,
    last_line,
    read_json,
    read_tail,
    read_text,
)


def trained_with(run_dir):
    """What a preset=auto run trains with now, read where it is written once (one writer: the
    master's supervisor appends each step down to step_downs.jsonl; the plan wrote the ladder,
    auto.json, at launch): the ladder's step, its preset, micro-batch, predicted peak and ds_config
    file; None for a run without a ladder (it trains with its launch's configuration)."""
    ladder = (read_json(RunDir(run_dir) / RunDir.AUTO) or {}).get("ladder")
    if not isinstance(ladder, list) or not ladder:
        return None
    index = min(len(step_downs(run_dir)), len(ladder) - 1)
    step = ladder[index] if isinstance(ladder[index], dict) else {}
    return {"step": index, "preset": step.get("preset"), "micro_batch": step.get("micro_batch"),
            "predicted": step.get("predicted"), "ds_config": RunDir.step_config(index)}


def memory_summary(run_dir):
    """The run's predicted peak per GPU (memory.json; that of the ladder step it trains at, after a
    step down) against its ranks' measured ones on this node (memory.jsonl, those of that
    configuration): predicted, measured (the largest rank's), ratio, over (by more than the
    tolerance, 5 %) and a line that says so; None where neither is there."""
    run = RunDir(run_dir)
    predicted = read_json(run / RunDir.MEMORY) or {}
    trained = trained_with(run_dir)
    if predicted and trained and trained["step"]:
        predicted = dict(predicted, preset=trained["preset"], micro_batch=trained["micro_batch"],
                         predicted=trained["predicted"])
    peaks = {}
    try:
        for text in read_text(run / RunDir.MEASURED, LINES_LIMIT).splitlines():
            try:
                m = json.loads(text)
            except ValueError:
                continue
            if predicted and (m.get("preset"), m.get("micro_batch")) != (predicted.get("preset"), predicted.get("micro_batch")):
                continue  # an earlier step of the ladder's
            peaks[m.get("rank")] = max(peaks.get(m.get("rank"), 0), int(m.get("max_allocated") or 0))
    except OSError:
        pass
    if not predicted and not peaks:
        return None
    out = {k: predicted.get(k) for k in ("key", "preset", "micro_batch", "world", "predicted")}
    measured = max(peaks.values()) if peaks else None
    out.update(measured=measured, ranks=len(peaks), ratio=None, over=False, note=None)
    if measured and predicted.get("predicted"):
        ratio = measured / predicted["predicted"]
        out["ratio"] = round(ratio, 3)
        out["over"] = ratio > float(predicted.get("tolerance", 1.05))
        out["note"] = (f"measured {measured / 2**30:.2f} GiB per GPU against the predicted "
                       f"{predicted['predicted'] / 2**30:.2f} GiB (x{ratio:.2f})"
                       + (f": over the prediction by {100 * (ratio - 1):.0f} %; a later preset=auto of the "
                          f"same code and model uses the measured figure" if out["over"] else ""))
    return out


def runs(run_root):
    """The runs under the run root, newest first: id, started (a launcher log exists), active,
    finished (exit code 0)."""
    out = []
    for e in entries(run_root):
        if not e.is_dir(follow_symlinks=False) or e.name.startswith("."):  # .secrets: no run
            continue
        d = RunDir(e.path)
        try:
            finished = read_text(d / RunDir.EXIT).strip() == "0"
        except OSError:
            finished = False
        out.append({"id": e.name, "mtime": e.stat(follow_symlinks=False).st_mtime,
                    "started": (d / RunDir.LOG).exists(), "active": bool(pid_alive(d / RunDir.PID)),
                    "finished": finished, "launch": read_json(d / RunDir.LAUNCH),
                    "trained": trained_with(e.path),
                    "memory": memory_summary(e.path),
                    "secrets": has_secrets(e.path)})
    return sorted(out, key=lambda r: r["mtime"], reverse=True)


ERROR_LINE = re.compile(r"(Traceback|Error|error:|Killed|exits with return code = [1-9]|"
                        r"was not reachable|Address already in use)")


# A Python exception's last line as pdsh passes it on ("node2: ValueError: ..."), with the
# "[rankN]:" prefix torch's elastic logging adds.
EXCEPTION = re.compile(r"^(?:(\S+): )?(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt)\b.*)$")


# A line of a launcher's logger ("[2026-12-02 06:32:15,790] [INFO] [launch.py:145:main] ..."):
# pdsh copies a node's stdout (the launcher's log) and stderr (the rank's traceback) line by line
# as each is ready, so on a busy node the two interleave.
LAUNCHER_LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[[A-Z]+\] ")


def first_error(log, offset=0):
    """(the first error of the attempt whose output starts at offset, that node's traceback):
    the first exception line (type and message, with the node that printed it), else the first
    line that looks like an error; the traceback is that node's output before it from its
    "Traceback" line, without the launcher's log lines: the header and up to 19 last lines."""
    try:  # the attempt's output, its last 4 MiB at most
        data, _ = read_tail(log, 4 << 20, offset)
        lines = data.decode(errors="replace").splitlines()
    except OSError:
        return None, []
    for i, line in enumerate(lines):
        m = EXCEPTION.match(line.strip())
        if m and "Warning" not in line:
            node = m.group(1)
            prefix = node + ": " if node else ""
            own = [x for x in lines[:i] if x.startswith(prefix)
                   and not LAUNCHER_LOG_LINE.match(x[len(prefix):])]
            start = max((j for j, x in enumerate(own) if "Traceback" in x), default=len(own))
            trace = own[start:] + [line]
            return line.strip()[:400], trace[:1] + trace[1:][-19:]
    for line in lines:
        if ERROR_LINE.search(line) and "UserWarning" not in line:
            return line.strip()[:400], []
    return None, []


def wait_for_end(run_dir, seconds, every=0.5):
    """Wait up to `seconds` while this node's supervisor of the run lives: a followed run's poll
    (status and log with --wait) spends its interval here, on the node, and returns as soon as
    the run ends instead of at the next poll."""
    deadline = time.monotonic() + seconds
    pid_file = RunDir(run_dir) / RunDir.PID
    while pid_alive(pid_file) and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(every, left))


def _small(path):
    """A one-line record of the run (its exit code, its restarts), stripped; None where it is
    missing or refused."""
    try:
        return read_text(path, 4096).strip()
    except OSError:
        return None


def status(run_dir, run_id, rdma=()):
    """The run's state on this node, and what it recorded; `rdma`: this node's RDMA ports
    (probe.rdma), against which NCCL's transport is judged."""
    run = RunDir(run_dir)
    ps = procs(run_id)
    launcher = pid_alive(run / RunDir.PID)
    # Where this node's supervisor started ranks itself (one node, or no_ssh mode), its own
    # ranks, not those of another node on the same host; pdsh's come through sshd.
    own = ranks_of(started_by(ps, launcher)) if launcher else []
    ranks = len(own or ranks_of(ps))
    code = _small(run / RunDir.EXIT)
    # A worker has no launcher of its own (pdsh starts its ranks): its ranks say it runs, and
    # the supervisor writes the exit code into every node's run directory when the run ends.
    if launcher or (ranks and code is None):
        state = "stalled" if launcher and (run / RunDir.STALLED).exists() else "running"
    elif (run / RunDir.RESTARTING).exists() and not (run / RunDir.STOPPED).exists():
        state = "restarting"  # Slurm's batch job, between two attempts on every node
    elif code == "0":
        state = "finished"
    elif (run / RunDir.STOPPED).exists():
        state = "stopped"
    elif code is not None:
        state = "failed"
    elif not (run / RunDir.LOG).exists():  # a worker (no launcher here), or a run not yet started
        state = "ended" if (run / RunDir.RANKS_STARTED).exists() else "not started"
    else:
        state = "lost"  # launcher gone without an exit code (killed with the node)
    last = last_line(run / RunDir.METRICS) or last_line(run / RunDir.PROGRESS)
    restarts = _small(run / RunDir.RESTARTS) or "0"
    failure = read_json(run / RunDir.FAILURE)
    error, trace = None, []
    if state in ("failed", "lost"):
        offset = (read_json(run / RunDir.ATTEMPT) or {}).get("offset", 0)
        error, trace = first_error(run / RunDir.LOG, offset)
        if failure:
            error = f"{failure['message']}; first error: {error}" if error else failure["message"]
    try:
        started = (run / RunDir.RUN_ID).stat().st_mtime
    except OSError:
        started = None
    return {"host": socket.gethostname(), "run_id": run_id, "state": state, "exit_code": code,
            "started": started, "total_steps": total_steps(last),
            "launcher_pid": launcher, "ranks_alive": ranks,
            "processes": len(ps), "last": last, "restarts": int(restarts),
            "failed_node": failure["node"] if failure and state in ("failed", "lost") else None,
            "first_error": error, "traceback": trace, "memory": memory_summary(run_dir),
            "step_downs": step_downs(run_dir), "shrinks": shrinks(run_dir), "config": config_label(run),
            "op_build": op_build(run_dir, {p["pid"] for p in ps}),
            "stopped_by": stopped_by(run) if state == "stopped" else None,
            "stall_stacks": (read_json(run / RunDir.STALLED) or {}).get("stacks", []) if state == "stalled" else [],
            # the rank the others wait for, while it is so (the supervisor's, dscnode.stragglers)
            "slow": read_json(run / RunDir.SLOW) if state in ("running", "stalled") else None,
            "nccl": nccl_report(run, rdma)}


def nccl_report(run, rdma):
    """Which transport this node's GPU ranks of the current attempt chose, and their last NCCL
    WARN (dscnode.nccllog, from the files the entry shim has NCCL write); None without such files."""
    try:
        since = (run / RunDir.RANKS_STARTED).stat().st_mtime - 1  # the attempt's ranks started
    except OSError:
        return None
    return nccllog.node_report(run / RunDir.NCCL, since, rdma)


def op_build(run_dir, pids):
    """The DeepSpeed ops this node's ranks are building now (the entry shim's op_builds.jsonl: a
    build started by one of the run's live processes, `pids`, and not ended), with when the
    first started and a line that says so; None when none is. Several ranks of a node wait on
    one build of an op: it counts once."""
    started = {}
    try:
        lines = read_text(RunDir(run_dir) / RunDir.OP_BUILDS, LINES_LIMIT).splitlines()
    except OSError:
        return None
    for text in lines:
        try:
            r = json.loads(text)
            key = (int(r["pid"]), str(r["op"]))
        except (ValueError, KeyError, TypeError):
            continue
        if r.get("event") == "start":
            started[key] = (float(r.get("time") or 0), str(r.get("builder") or ""))
        else:
            started.pop(key, None)
    building = {}
    for (pid, op), (since, builder) in started.items():
        if pid in pids and (op not in building or since < building[op][0]):
            building[op] = (since, builder)
    if not building:
        return None
    ops, builders = sorted(building), sorted({b for _, b in building.values() if b})
    plural, it = ("s", "them") if len(ops) > 1 else ("", "it")
    warm = f"; deepspeed_warm_ops with {', '.join(builders)} builds {it} at provision" if builders else ""
    return {"ops": ops, "since": min(s for s, _ in building.values()),
            "note": f"building DeepSpeed op{plural} {', '.join(ops)} (first use on this node: "
                    f"compiled once, can take minutes{warm})"}


def total_steps(last):
    """The run's total steps where its writer knew it: train.run's metrics carry its config's
    steps, the entry shim's progress HF's Trainer's max_steps; None for any other script, and
    None where the step is past it (a total that is not the run's)."""
    last = last or {}
    total, step = last.get("total_steps"), last.get("step")
    if not isinstance(total, int) or total <= 0 or (isinstance(step, int) and step > total):
        return None
    return total


def config_label(run):
    """What decides the run's DeepSpeed configuration, as the launch message and runs.yml say it:
    "preset zero2" where the toolkit's preset is the config (dsc_ds_config_mode preset);
    otherwise (the user's file, HF's Trainer, the script itself) the ZeRO stage its engine
    reported ("ZeRO stage 3"), and "its own ZeRO stage" before it has. None without a launch
    record."""
    launch = read_json(run / RunDir.LAUNCH)
    if not isinstance(launch, dict):
        return None
    if launch.get("dsc_ds_config_mode", "preset") == "preset":
        return f"preset {(trained_with(run.path) or launch).get('preset')}"
    stage = (read_json(run / RunDir.ENGINE) or {}).get("zero_stage")
    return f"ZeRO stage {stage}" if isinstance(stage, int) else "its own ZeRO stage"


def stopped_by(run):
    """Who stopped the run on purpose, as the stop marker names it (stop.yml, a replacing
    launch); None for a marker that names no one."""
    try:
        said = read_text(run / RunDir.STOPPED).strip()
    except OSError:
        return None
    return said if said and said != "stopped" else None


def continued(record):
    """A run gone on on other nodes (dscnode.shrink's record: fewer after a node was lost, or one
    taken in again at a resume) in words: the log, status, follow."""
    lost, back = record.get("lost") or [], record.get("back") or []
    at = f" at step {record['at_step']}" if record.get("at_step") is not None else ""
    since = (f", from checkpoint {record['checkpoint']}" if record.get("checkpoint")
             else ", from the start (no checkpoint saved)")
    batch = (f"; global batch {record['train_batch']} as micro-batch {record['micro_batch']} x "
             f"{record['grad_accum']} accumulation x {record['world']} ranks") if record.get("train_batch") else ""
    what = [f"after {', '.join(lost)} {'was' if len(lost) == 1 else 'were'} lost{at}"] if lost else []
    what += [f"with {', '.join(back)} taken in again"] if back else []
    return (f"continued on {len(record['nodes'])} of {record['of']} nodes {' and '.join(what)}{since}{batch}"
            + (f" ({record['why']})" if record.get("why") else ""))


def shrinks(run_dir):
    """The run's continuations on fewer nodes so far (dsc_min_nodes), each with its words (said)."""
    return [dict(r, said=continued(r)) for r in last_lines(RunDir(run_dir) / RunDir.SHRINKS, 100)
            if isinstance(r.get("lost"), list) and isinstance(r.get("nodes"), list)]


def step_downs(run_dir):
    """preset=auto's out-of-memory steps down so far: each failed attempt's configuration and
    cause, and the configuration it stepped down to."""
    try:
        return [json.loads(x) for x in read_text(RunDir(run_dir) / RunDir.STEP_DOWNS, LINES_LIMIT).splitlines()
                if x.strip()]
    except (OSError, ValueError):
        return []


def log_tail(run_dir, run_id, lines=20, hosts=()):
    """The end of the run's launcher log (every node's output comes through pdsh, each line
    prefixed by its node's name): its path, the last `lines` lines of each node ("launcher" for
    the lines of no node's ranks: DeepSpeed's runner, pdsh, the supervisor), and the raw tail
    with the byte offset it starts at, from which follow streams; with the run's state."""
    log = RunDir(run_dir) / RunDir.LOG
    try:
        data, start = read_tail(log, max(65536, lines * 400 * max(1, len(hosts))))
    except OSError:
        data, start = b"", 0
    cut = data.find(b"\n") + 1 if start else 0  # from the first whole line
    data, start = data[cut:], start + cut
    end = data.rfind(b"\n") + 1  # up to the last whole line
    text = data[:end].decode(errors="replace")
    nodes = {}
    for line in text.splitlines():
        name, _, rest = line.partition(": ")
        node = name if name in hosts and rest else "launcher"
        nodes.setdefault(node, []).append(rest if node != "launcher" else line)
    return {"run_id": run_id, "state": status(run_dir, run_id)["state"], "log": str(log), "offset": start,
            "text": text, "nodes": {k: v[-lines:] for k, v in nodes.items()} if lines else {}}


def history(run_dir):
    """What plots draw: {"steps": every logged step of the run (train.run's metrics.jsonl, else
    the entry shim's progress.jsonl), "ranks": every window of ranks.jsonl as {step, ranks: [{rank,
    node, compute_s}]}, the rest of each rank's figures left here}. A line that is not a JSON object
    (one rank 0 is still writing) is passed over."""
    run = RunDir(run_dir)

    def lines(name):
        return list(json_objects(read_text(run / name, HISTORY_LIMIT).splitlines()))
    out = {"steps": [], "ranks": []}
    for name in (RunDir.METRICS, RunDir.PROGRESS):
        try:
            out["steps"] = lines(name)
            break
        except OSError:
            continue
    try:
        out["ranks"] = [{"step": w.get("step"), "ranks": [{k: r.get(k) for k in ("rank", "node", "compute_s")}
                                                          for r in w.get("ranks") or [] if isinstance(r, dict)]}
                        for w in lines(RunDir.RANKS)]
    except OSError:
        pass
    return out


def runs_table(run_root):
    """Every run under the run root, newest first: id, config (config_label), state, last step,
    loss, throughput (tokens/s from train.run's metrics, samples/s from any other script's
    progress), started, duration and restarts (runs.yml's table)."""
    rows, now = [], time.time()
    for r in runs(run_root):
        run = RunDir(Path(run_root) / r["id"])
        st = status(run.path, r["id"])
        try:
            started = (run / RunDir.RUN_ID).stat().st_mtime
        except OSError:
            started = r["mtime"]
        try:
            ended = (run / RunDir.EXIT).stat().st_mtime
        except OSError:
            ended = None if st["state"] == "running" else r["mtime"]
        last = st["last"] or {}
        rows.append({"id": r["id"], "config": st["config"], "state": st["state"],
                     "step": last.get("step"), "loss": last.get("loss"),
                     "tokens_per_s": last.get("tokens_per_s"), "samples_per_s": last.get("samples_per_s"),
                     "started": started, "duration_s": round((ended or now) - started, 1),
                     "restarts": st["restarts"], "slow": st["slow"],
                     "nodes": f"{len(st['shrinks'][-1]['nodes'])} of {st['shrinks'][-1]['of']}" if st["shrinks"] else None})
    return sorted(rows, key=lambda row: row["started"], reverse=True)


def run_files(run_dir):
    """Every file of the run directory but its code and checkpoints (what logs.yml fetches):
    logs, metrics, monitor output, summaries, the rendered config."""
    run, out = Path(run_dir), []
    for dirpath, dirnames, filenames in os.walk(run):
        if Path(dirpath) == run:
            dirnames[:] = [d for d in dirnames if d not in (RunDir.CODE, RunDir.CHECKPOINTS)]
        out += [str(Path(dirpath, f).relative_to(run)) for f in filenames if not f.endswith(".tmp")]
    return sorted(out)


def in_attempt(st, master_state):
    """A node's status as the run's current attempt has it: a worker has no supervisor of its own
    to mark a stall (the master's marks it), so while the master's status says stalled, a worker
    whose ranks run is stalled with it."""
    if master_state == "stalled" and (st or {}).get("state") == "running":
        return dict(st, state="stalled")
    return st


def node_states(run_dir, run_id, hosts, own):
    """{node: {state, ranks_alive}} for follow's line: this node's own (`own`, its status), the
    others' through pdsh (the same way the launcher reaches them); a node that does not answer is
    "unreachable", with no rank counted."""
    def of(st):
        return {"state": st["state"], "ranks_alive": int(st.get("ranks_alive") or 0)}
    states = {hosts[0]: of(own)} if hosts else {}
    others = list(hosts)[1:]
    if not others:
        return states
    r = subprocess.run(["pdsh", "-R", "ssh", "-t", "5", "-u", "20", "-w", ",".join(others),
                        program(), "status", str(run_dir), run_id],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       env=dict(os.environ, PDSH_RCMD_TYPE="ssh"), check=False)
    for line in r.stdout.splitlines():
        name, _, text = line.partition(": ")
        try:
            states[name] = of(json.loads(text))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return {h: in_attempt(states.get(h, {"state": "unreachable", "ranks_alive": 0}), own["state"]) for h in hosts}
