"""The supervisor that start detaches for a run (its pid is the run's launcher.pid, restarts
included): it runs DeepSpeed's launcher, watches its log, tears the run down everywhere when a node
fails or the run stalls, restarts it from its latest checkpoint (max_restarts), steps preset=auto's
ladder down after an out-of-memory error in the first steps, and records how the run ended on
every node."""
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

from dscnode import complete, copies, gpuhealth, shrink, stragglers
from dscnode.entry import EngineWatch
from dscnode.procs import on_others, teardown, write_pid
from dscnode.records import step_downs
from dscnode.rundir import RunDir, append_line, last_line, last_lines, read_json, size_of, write_atomic
from dscnode.safe import SHELL_SAFE, latest_glob
from dscnode.stacks import at_stall


# What the launchers print when a node's ranks end badly: launch.py on the node (pdsh prefixes its
# lines with the node name), and pdsh itself when a node's ssh session ends non-zero (255: the
# connection was lost, e.g. the node died).
RANK_EXIT = re.compile(r"^(\S+): .*exits with return code = (-?\d+)")
SSH_EXIT = re.compile(r"^pdsh@\S+: (\S+): ssh exited with exit code (\d+)")
# A stall is the supervisor's own verdict, taken only while no other failure was seen: what its
# teardown then causes (lost sessions, killed ranks) is not the cause.
CAUSE_ORDER = {"stall": -1, "signal": 0, "lost": 1, "exit": 2}
# An out-of-memory error as a rank prints it (torch.OutOfMemoryError, "CUDA out of memory").
OUT_OF_MEMORY = re.compile(r"(OutOfMemoryError|CUDA out of memory)")
# preset=auto steps down only while the run has made no more optimizer steps than this.
FIRST_STEPS = EngineWatch.MEASURE_STEPS


def failure_event(line):
    """A node's failure as the launcher log shows it, or None."""
    m = RANK_EXIT.match(line)
    if m and m.group(2) != "0":
        code = int(m.group(2))
        return {"node": m.group(1), "code": code, "kind": "signal" if code < 0 else "exit",
                "line": line.strip()[:400]}
    m = SSH_EXIT.match(line)
    if m:
        code = int(m.group(2))
        return {"node": m.group(1), "code": code, "kind": "lost" if code == 255 else "exit",
                "line": line.strip()[:400]}
    return None


def describe(cause):
    if cause["kind"] == "signal":
        name = signal.Signals(-cause["code"]).name if -cause["code"] in signal.Signals._value2member_map_ else cause["code"]
        return f"a rank on {cause['node']} was killed by {name}"
    if cause["kind"] == "stall":
        return f"the run stalled: no step for {cause['limit_s']:.0f} s after step {cause['step']}"
    if cause["kind"] == "lost":
        return f"the connection to {cause['node']} was lost (node down or sshd gone)"
    if cause["kind"] == "gpu_health":
        return f"the GPU gate refused the restart: {'; '.join(cause['findings'])}"
    if cause["kind"] == "nodes":
        return f"the run cannot start on {', '.join(cause['nodes'])}: {cause['why']}"
    return f"ranks on {cause['node']} exited with code {cause['code']}"


class SlowRank:
    """The node the others wait for, while the run moves (dscnode.stragglers): judged from the
    windows global rank 0 gathers into ranks.jsonl (this attempt's only), marked in slow.json with
    a line in the log, cleared (the file removed, a line said) when it catches up, or when its
    ranks no longer send figures (said as that, not as caught up)."""

    # The bytes of ranks.jsonl read for the windows written since the last check (every 2 s): a
    # rank's entry is ~120 bytes, so 3 lines of ~10,000 ranks, hundreds of a few nodes'.
    TAIL = 4 << 20
    NEW = 256  # windows read at most per check

    def __init__(self, run):
        self.run, self.size, self.mark = run, size_of(run / RunDir.RANKS), None
        self.start, self.streak, self.step = self.size, stragglers.Streak(), None
        (run / RunDir.SLOW).unlink(missing_ok=True)

    def check(self):
        size = size_of(self.run / RunDir.RANKS)
        if size == self.size:
            return self.mark
        self.size = size
        windows = [w for w in last_lines(self.run / RunDir.RANKS, self.NEW, self.TAIL, self.start)
                   if self.step is None or (w.get("step") or 0) > self.step]
        if not windows:
            return self.mark
        for w in windows:
            self.streak.add(w)
        self.step = windows[-1].get("step") or 0
        mark = self.streak.mark()
        if self.mark and (not mark or mark["node"] != self.mark["node"]):
            print(f"[dsc_node] slow rank {self.mark['rank']} on {self.mark['node']} "
                  f"{stragglers.cleared(self.mark, windows[-1])}", flush=True)
        if mark:
            if not (self.mark and mark["node"] == self.mark["node"]):
                print(f"[dsc_node] slow rank: {stragglers.said(mark)}", flush=True)
            best_effort(write_atomic, self.run / RunDir.SLOW,
                        json.dumps(dict(mark, said=stragglers.said(mark), short=stragglers.short(mark))) + "\n")
        elif self.mark:
            (self.run / RunDir.SLOW).unlink(missing_ok=True)
        self.mark = mark
        return mark

    def end(self):
        (self.run / RunDir.SLOW).unlink(missing_ok=True)


class Stall:
    """A run whose ranks are alive but complete no step: a collective that never returns (a
    peer stopped, an NCCL hang) looks exactly like that. The steps are global rank 0's
    (train.run's metrics.jsonl, any script's progress.jsonl, both on the master); before the
    first one of this attempt nothing is judged (start-up, op builds, a restart loading its
    checkpoint: the lines an earlier attempt wrote do not count). Stalled after `timeout_s`
    without a new step; 0 means 10x the median step time, at least `min_s`."""

    def __init__(self, run, timeout_s=0.0, min_s=300.0):
        self.run, self.timeout_s, self.min_s = run, float(timeout_s), float(min_s)
        self.step, self.since, self.per_step = None, time.time(), []
        self.start = {name: size_of(run / name) for name in (RunDir.METRICS, RunDir.PROGRESS)}
        (run / RunDir.STALLED).unlink(missing_ok=True)

    def limit(self):
        if self.timeout_s > 0:
            return self.timeout_s
        times = sorted(self.per_step)
        return max(self.min_s, 10 * times[len(times) // 2]) if times else self.min_s

    def check(self, now):
        """None while steps come; else the stall record, written to stalled.json."""
        last = next(filter(None, (last_line(self.run / name, start) for name, start in self.start.items())), {})
        step = last.get("step")
        if step is not None and step != self.step:
            if self.step is not None and step > self.step:
                self.per_step.append((now - self.since) / (step - self.step))
            self.step, self.since = step, now
            (self.run / RunDir.STALLED).unlink(missing_ok=True)
            return None
        if self.step is None or now - self.since < self.limit():
            return None
        record = {"step": self.step, "since": round(self.since, 3), "limit_s": round(self.limit(), 1)}
        if not (self.run / RunDir.STALLED).exists():
            write_atomic(self.run / RunDir.STALLED, json.dumps(record) + "\n")
            print(f"[dsc_node] stalled: no step for {record['limit_s']:.0f} s after step {self.step}",
                  flush=True)
            record["first"] = True
        return record


def watch(child, run, run_id, hosts, pos, grace=3.0, stall=None, seen=None, copier=None):
    """Wait for the launcher; when a node fails and the run has not ended grace seconds later
    (ranks elsewhere blocked in a collective with a dead peer), tear it down everywhere. A
    stall (`stall`: {timeout_s, fail, py_spy, ras}) is marked in the run directory, with every rank's
    stack (py_spy: the env's py-spy), and with fail it ends the attempt as a failure (teardown, then a restart when max_restarts allows). `seen` (a dict) gets
    the attempt's first out-of-memory line ("oom"); `copier` (copies.Copier) keeps each new
    checkpoint's parts on other nodes meanwhile."""
    seen = {} if seen is None else seen
    log = run / RunDir.LOG
    events, deadline, torn = [], None, None
    stall = stall or {}
    stalls, checked = Stall(run, stall.get("timeout_s", 0), stall.get("min_s", 300)), 0.0
    slow = SlowRank(run)
    while True:
        code = child.poll()
        with open(log, errors="replace") as f:
            f.seek(pos)
            chunk = f.read()
        done = chunk.rfind("\n") + 1
        pos += len(chunk[:done].encode(errors="replace"))
        for line in chunk[:done].splitlines():
            if "oom" not in seen and OUT_OF_MEMORY.search(line):
                seen["oom"] = line.strip()[:400]
            ev = failure_event(line)
            if ev:
                ev["time"] = time.time()
                events.append(ev)
        if code is not None:
            break
        if time.time() - checked >= 2:
            checked = time.time()
            slow.check()
            if copier:
                copier.poll()
            stalled = stalls.check(checked)
            if stalled and stalled.get("first") and (stall.get("py_spy") or stall.get("ras")):
                try:
                    at_stall(str(run.path), run_id, list(hosts), stall.get("py_spy"), stall.get("ras"))
                except Exception as e:  # noqa: BLE001 - a diagnosis: supervising the run goes on
                    print(f"[dsc_node] the ranks' stacks were not read: {e}", flush=True)
            if stalled and stall.get("fail") and deadline is None:
                events.append({"node": hosts[0] if hosts else socket.gethostname(), "kind": "stall",
                               "code": -1, "time": time.time(), "step": stalled["step"],
                               "limit_s": stalled["limit_s"], "line": ""})
                deadline = time.time()
        if events and deadline is None:
            deadline = time.time() + grace
        if deadline and torn is None and time.time() >= deadline:
            torn = {"started": time.time()}
            child.kill()  # not TERM: the runner would pkill other runs' launchers by pattern
            torn.update(teardown(run_id, hosts))
            torn["done"] = time.time()
        time.sleep(0.5)
    slow.end()
    cause = min(events, key=lambda e: (CAUSE_ORDER[e["kind"]], e["time"])) if events else None
    return code, cause, torn


MATCHES_LIMIT = 1000  # a glob's matches a node reports for {latest:GLOB}, the newest


def matches(pattern, cwd="."):
    """The paths matching the glob, newest first: by the last number in the name (checkpoint-40
    before checkpoint-9), then by mtime. Only a match inside `cwd` counts (a link there that
    leads out of it does not), of the characters a command line takes unquoted."""
    home = os.path.realpath(cwd)

    def inside(p):
        real = os.path.realpath(os.path.join(cwd, p))
        return real.startswith(home + "/") and SHELL_SAFE.fullmatch(p)

    def key(p):
        return complete.step_of(p), os.path.getmtime(os.path.join(cwd, p))
    return sorted((p for p in glob.glob(pattern, root_dir=cwd) if inside(p)), key=key, reverse=True)[:MATCHES_LIMIT]


def match_states(pattern, cwd="."):
    """{match: complete.match_state} of this node's matches (the node helper's `matches`)."""
    return {m: complete.match_state(os.path.join(cwd, m)) for m in matches(pattern, cwd)}


def newest_complete(pattern, cwd=".", hosts=()):
    """The newest match complete on this node and on every other of `hosts` that answers (the
    pdsh launch mode's: the supervisor reaches them; elsewhere it decides for its own node),
    said in the launcher's log with what it passed over."""
    cwd = os.path.abspath(cwd)
    hosts = list(hosts) or ["this node"]
    nodes, states = hosts[:1], [match_states(pattern, cwd)]
    answers = on_others(hosts, "matches", pattern, "--cwd", cwd)
    for host in hosts[1:]:
        try:
            states.append(json.loads(answers.get(host, "")))
            nodes.append(host)
        except ValueError:
            pass  # no answer: the attempt itself finds the node unreachable
    match, passed = complete.newest_everywhere(states, nodes)
    print(said_latest(pattern, match, nodes, passed, [h for h in hosts if h not in nodes]), flush=True)
    return match


def said_latest(pattern, match, nodes, passed, unheard=()):
    """What a `{latest:GLOB}` took, on which nodes, and what it passed over, as the launcher's log
    says it."""
    return (f"[dsc_node] {{latest:{pattern}}}: {match or 'none complete on every node, the run starts over'}"
            f"{', the newest complete on ' + ', '.join(nodes) if match else ''}"
            f"{'; passed over: ' + ', '.join(passed) if passed else ''}"
            f"{'; no answer from ' + ', '.join(unheard) if unheard else ''}")


def latest_states(patterns, cwd=".", node=""):
    """This node's part of an agreement on `{latest:GLOB}` where no supervisor reaches the other
    nodes (the no_ssh and slurm launch modes): {node: its name (`node`, else Slurm's name for it,
    else its host name), states: {glob: match_states}}, a line that agree_latest reads with every
    other node's."""
    name = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return {"node": name, "states": {p: match_states(p, cwd) for p in patterns}}


def agree_latest(lines):
    """Every node's latest_states (JSON lines; the nodes in the order given) -> ({glob: {path: the
    newest match complete on every node ("" for none), said: what it took and passed over, as
    newest_complete says it}}, the nodes whose lines were read: a line that is not a node's states
    is left out, and the caller refuses an agreement that misses a node)."""
    answers = []
    for line in lines:
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict) and isinstance(answer.get("states"), dict):
            answers.append(answer)
    nodes = [str(a.get("node")) for a in answers]
    agreed = {}
    for pattern in dict.fromkeys(p for a in answers for p in a["states"]):
        match, passed = complete.newest_everywhere([a["states"].get(pattern) or {} for a in answers], nodes)
        agreed[pattern] = {"path": match or "", "said": said_latest(pattern, match, nodes, passed)}
    return agreed, nodes


def resolve_latest(argv, cwd=".", hosts=(), agreed=None):
    """A script's resume arguments, as the plan allows them: `{latest:GLOB}` becomes the newest
    match complete on every node (newest_complete; e.g. HF's --resume_from_checkpoint
    out/checkpoint-40), or what every node agreed it is before the start (`agreed`: agree_latest's,
    where no supervisor reaches the others); with none yet (stopped before the first save) it is
    dropped with the option right before it, and the run starts over."""
    out = []
    for arg in argv:
        pattern = latest_glob(arg)
        if pattern is None:
            out.append(arg)
            continue
        if agreed is not None and pattern in agreed:
            path = agreed[pattern]["path"]
            if path and path not in matches(pattern, cwd):  # never a path that is not a match here
                print(f"[dsc_node] {{latest:{pattern}}}: the agreed {path} is not here; the run starts over", flush=True)
                path = ""
            else:
                print(agreed[pattern]["said"].replace("\n", " ") + " (agreed before the start)", flush=True)
        else:
            path = newest_complete(pattern, cwd, hosts)
        if path:
            out.append(path)
        elif out and out[-1].startswith("-"):
            out.pop()
    return out


def gpu_gate(hosts, used_gpus):
    """The GPU gate before a restart (dscnode.gpuhealth's quick subset, as launch's): the failing
    findings of every node the supervisor restarts, "<node> GPU i: what" each; [] where all pass
    or no node uses a GPU. This node's own here, the others' through pdsh, one call for the nodes
    that use the same GPUs. As the training user: the kernel log's Xids are read where it may."""
    if not hosts:
        return []
    health = {}
    if used_gpus.get(hosts[0]):
        health[hosts[0]] = gpuhealth.report(used_gpus[hosts[0]])
    alike = {}
    for host in hosts[1:]:
        if used_gpus.get(host):
            alike.setdefault(json.dumps(used_gpus[host]), []).append(host)
    for ids, group in alike.items():
        for host, said in on_others([hosts[0], *group], "gpu-health", "--gpus", ids).items():
            try:
                health[host] = json.loads(said)
            except ValueError:
                pass  # no answer: the restart itself finds the node unreachable
    return [f"{host} {f['what']}" for host in hosts for f in (health.get(host) or {}).get("findings", [])
            if f["status"] == "FAIL"]


def record_failure(run, cause, **fields):
    """failure.json: the attempt's cause in words beside its own fields (status shows it)."""
    best_effort(write_atomic, run / RunDir.FAILURE, json.dumps(dict(cause, message=describe(cause), **fields)) + "\n")


def gate_cause(refused):
    """The run's cause where the GPU gate refused a restart (gpu_gate's findings), as status shows it."""
    return {"kind": "gpu_health", "node": refused[0].split(" ")[0], "findings": refused}


def with_resume(cmd, resume_args):
    """The command of a restart: it resumes from the latest complete checkpoint (resume_args
    appended, unless it ends with them already: a resumed run's own command)."""
    resumes = list(resume_args) and list(cmd[-len(resume_args):]) == list(resume_args)
    return list(cmd) + ([] if resumes else list(resume_args))


def supervise(run, run_id, cmd, hosts, max_restarts, backoff, resume_args=(), stall=None, used_gpus=None,
              keep_copies=True, agreed=None):
    log = os.open(run / RunDir.LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = sys.stderr = Unfailing(sys.stdout)  # the log on a full disk ends no supervisor
    write_pid(run / RunDir.PID, os.getpid())
    reserve_exit(run)
    env = dict(os.environ, DSC_RUN_ID=run_id, DSC_RUN_DIR=str(run.path))
    restarts_file = run / RunDir.RESTARTS
    restarts = int(restarts_file.read_text()) if restarts_file.exists() else 0
    # At the ladder step the run is at (a resumed or restarted run that stepped down keeps it).
    base = at_step(cmd, run, len(step_downs(run.path)))
    stall = dict(stall or {}, ras=any((used_gpus or {}).values()))  # on GPU nodes a stall asks NCCL's RAS too
    copier = copies.Copier(run, hosts, keep_copies, logged_step=lambda: run_steps(run))
    try:  # dsc_min_nodes: a run that went on on fewer nodes, launched again on others
        base = start_on(run, run_id, base, list(hosts), env)
    except (shrink.Refused, SystemExit, OSError) as e:
        cause = {"kind": "nodes", "node": hosts[0], "nodes": list(hosts), "why": str(e)}
        print(f"[dsc_node] {describe(cause)}", flush=True)
        record_failure(run, cause, exit_code=1, teardown=False, restarts=restarts)
        finish(run, hosts, 1)
    attempt, causes = list(base), []  # causes: each attempt's, for a node whose ranks keep dying
    while True:
        # Where this attempt's output starts, taken before the spawn: its first failure line is
        # never missed, and status reads the latest attempt's error, not an earlier one's.
        offset = (run / RunDir.LOG).stat().st_size
        (run / RunDir.FAILURE).unlink(missing_ok=True)  # the cause shown is this attempt's
        best_effort(write_atomic, run / RunDir.ATTEMPT,
                    json.dumps({"attempt": restarts + 1, "offset": offset}) + "\n")
        if copier.enabled:  # a node that lost its part of the newest checkpoint gets it back
            try:
                copies.restore(run, hosts)
            except Exception as e:  # noqa: BLE001 - the attempt still starts, from what the nodes hold
                print(f"[dsc_node] no checkpoint part was put back: {e}", flush=True)
        child = subprocess.Popen(resolve_latest(attempt, hosts=list(hosts), agreed=agreed), env=env, stdin=subprocess.DEVNULL)
        best_effort(write_atomic, run / RunDir.CHILD, str(child.pid))
        seen = {}
        code, cause, torn = watch(child, run, run_id, list(hosts), offset, stall=stall, seen=seen, copier=copier)
        causes.append(cause)
        if cause:
            record_failure(run, cause, exit_code=code, teardown=torn, restarts=restarts)
        if not (run / RunDir.STOPPED).exists():
            copier.finish()  # the attempt's last checkpoint too, before a restart or the run's end
        if code == 0 or (run / RunDir.STOPPED).exists():
            break
        down = step_down(run, seen.get("oom"), code)
        if down is not None:  # preset=auto: the next configuration of its ladder, from the start
            teardown(run_id, list(hosts))
            if (run / RunDir.STOPPED).exists():
                break
            base = at_step(cmd, run, down)
            attempt = list(base)
            continue
        if restarts >= max_restarts:
            break
        restarts += 1
        wait = min(backoff * 2 ** (restarts - 1), 600.0)
        best_effort(write_atomic, restarts_file, f"{restarts}\n")
        best_effort(append_line, run / RunDir.RESTARTS_LOG, json.dumps(
            {"restart": restarts, "time": time.time(), "after_exit_code": code,
             "cause": describe(cause) if cause else None, "backoff_s": wait}))
        print(f"[dsc_node] restart {restarts}/{max_restarts} in {wait:.0f} s from the latest "
              f"complete checkpoint ({describe(cause) if cause else f'exit code {code}'})", flush=True)
        teardown(run_id, list(hosts))  # nothing of the failed attempt may linger anywhere
        time.sleep(wait)
        if (run / RunDir.STOPPED).exists():
            break
        refused = gpu_gate(list(hosts), used_gpus or {})
        fewer = go_on_fewer(run, cmd, list(hosts), refused, env, causes)
        if fewer:  # dsc_min_nodes: on without the lost nodes, from their checkpoint converted
            (hosts, base), refused, causes = fewer, [], []
            copier = copies.Copier(run, hosts, keep_copies, logged_step=lambda: run_steps(run))
        if refused:  # no rank starts on a node whose GPU failed the gate
            cause = gate_cause(refused)
            print(f"[dsc_node] {describe(cause)}", flush=True)
            record_failure(run, cause, exit_code=code, teardown=True, restarts=restarts)
            break
        attempt = with_resume(base, resume_args)
    finish(run, hosts, code)


def finish(run, hosts, code):
    """The run's end: its exit code here and on every other node, and this supervisor gone."""
    record_exit(run, code)
    on_others(hosts, "write-exit", str(run.path), str(code))
    (run / RunDir.PID).unlink(missing_ok=True)
    # Detached, nobody reads this status; Slurm's task reports the run's (its job's state).
    os._exit(0 if code == 0 else 1)


def save_dir_of(run):
    """Where the run saved its last node-local checkpoint (SAVES), else its own directory."""
    recorded = copies.saves(run)
    return recorded[-1]["save_dir"] if recorded else str(run.path)


def go_on_fewer(run, cmd, hosts, refused, env, causes=()):
    """dsc_min_nodes, before a restart: (the survivors, the launch's command `cmd` for them) where
    a node is lost (it does not answer, the GPU gate refused it: `refused`, or its ranks were
    killed in the last two attempts: `causes`, each attempt's) and the run may go
    on without it (dscnode.shrink); None where no node is lost, dsc_min_nodes is not set or the
    run cannot go on (said in the log: the restart then goes as it would have)."""
    if not shrink.settings(run):
        return None
    held_by = copies.survey(hosts, save_dir_of(run))
    lost = shrink.lost_nodes(hosts, held_by, refused, causes)
    if not lost:
        return None
    survivors = [h for h in hosts if h not in lost]
    try:
        return survivors, shrink.regroup(run, cmd, hosts, survivors, held_by, env, lost_at=run_steps(run))
    except (shrink.Refused, SystemExit, OSError) as e:
        print(f"[dsc_node] the run cannot go on without {', '.join(lost)}: {e}", flush=True)
        return None


def start_on(run, run_id, cmd, hosts, env):
    """dsc_min_nodes, at a launch or resume: the command for `hosts`, where the run last ran on
    other nodes (it went on on fewer, a node is back, or one is left out: out of the inventory or
    not answering resume.yml): the newest checkpoint those saved converted for `hosts` first
    (dscnode.shrink.regroup), once no rank of the run is left on them (after a lost master its
    ranks elsewhere still wait in a collective). The launch's command `cmd` as it is where
    nothing changed; raises shrink.Refused."""
    found = shrink.settings(run)
    if not found:
        return cmd
    source = shrink.ran_on(run, found.get("nodes") or hosts)
    if source == hosts:
        return cmd if hosts == found.get("nodes") else shrink.command_for(run, cmd, hosts, env)[0]
    teardown(run_id, hosts)
    # this node first: the master, which may be another than the one the run last ran on (lost)
    asked = [hosts[0]] + [n for n in source if n != hosts[0]]
    return shrink.regroup(run, cmd, source, hosts, copies.survey(asked, save_dir_of(run)), env)


def run_steps(run):
    """The latest optimizer step the run has logged (train.run's metrics, any script's progress),
    or None."""
    steps = [(last_line(run / name) or {}).get("step") for name in (RunDir.METRICS, RunDir.PROGRESS)]
    steps = [x for x in steps if isinstance(x, int)]
    return max(steps) if steps else None


def step_down(run, oom, code):
    """preset=auto's answer to an out-of-memory error in the first steps (none past FIRST_STEPS):
    the next step of auto.json's ladder, recorded in step_downs.jsonl (the one record of what the
    run trains with: this supervisor alone writes it) and said in the log; its index, or None
    where it does not apply (no ladder, the ladder spent, another error, a run that already
    trained). The plan wrote every step's ds_config at launch: no file is rewritten."""
    ladder = read_json(run / RunDir.AUTO) or {}
    steps, at = ladder.get("ladder") or [], run_steps(run)
    index = len(step_downs(run.path))
    if not oom or index + 1 >= len(steps) or (at is not None and at > FIRST_STEPS):
        return None
    was, nxt = steps[index], steps[index + 1]
    record = {"attempt": index + 1, "time": round(time.time(), 3), "exit_code": code, "at_step": at,
              "preset": was["preset"], "micro_batch": was["micro_batch"], "cause": oom,
              "next": {k: nxt[k] for k in ("preset", "micro_batch", "grad_accum")}}
    best_effort(append_line, run / RunDir.STEP_DOWNS, json.dumps(record))
    print(f"[dsc_node] out of memory in the first steps at {was['preset']} micro-batch "
          f"{was['micro_batch']}: stepping down to {nxt['preset']} micro-batch {nxt['micro_batch']} "
          f"(step {index + 1} of {len(steps) - 1} of preset=auto's ladder)", flush=True)
    return index + 1


def at_step(cmd, run, index):
    """The command with the ds_config of preset=auto's ladder step `index` (every node runs the
    master's command: its ranks read that step's file, which the plan wrote on every node)."""
    first, this = str(run / RunDir.DS_CONFIG), str(run / RunDir.step_config(index))
    return [this if arg == first else arg for arg in cmd]


class Unfailing:
    """A stream whose writes never raise (the supervisor's log on a full disk)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError:
            return 0

    def flush(self):
        try:
            self.stream.flush()
        except OSError:
            pass


def best_effort(fn, *args, **kwargs):
    """A supervisor's record that may fail on a full disk: the supervisor goes on (it still has
    to tear down, restart and record the exit code)."""
    try:
        fn(*args, **kwargs)
    except OSError:
        pass


def reserve_exit(run):
    """Room for the exit code, taken while the disk has it: record_exit overwrites this file in
    place when a full disk refuses a new one."""
    best_effort(write_atomic, run / RunDir.EXIT_RESERVE, " " * 32 + "\n")


def record_exit(run, code):
    """The run's exit code, always: a new file, else (disk full) the reserved one rewritten in
    place and renamed (neither needs a free block)."""
    try:
        write_atomic(run / RunDir.EXIT, f"{code}\n")
        (run / RunDir.EXIT_RESERVE).unlink(missing_ok=True)
        return
    except OSError:
        pass
    with open(run / RunDir.EXIT_RESERVE, "r+") as f:
        f.write(f"{code}\n")
        f.truncate()
    os.replace(run / RunDir.EXIT_RESERVE, run / RunDir.EXIT)
