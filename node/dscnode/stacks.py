"""Where each of a run's ranks on this node is: its Python stack as py-spy reads it (`py-spy dump
--nonblocking`: the rank is not paused, and one stopped by SIGSTOP is read too, which a paused
dump cannot), with its global rank and process state, saved in the run directory
(stacks/<time>-<node>.json) for the control node's summary (plugins/filter/cluster.py). Run as
the training user, who owns the ranks: reading their memory needs nothing more."""
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

from dscnode import ncclras
from dscnode.procs import Blind, on_others, procs, ranks_of
from dscnode.rundir import RunDir, read_json, write_atomic

# /proc/PID/stat's state letters, in words.
STATES = {"R": "running", "S": "sleeping", "D": "disk wait", "T": "stopped", "t": "traced",
          "Z": "zombie", "I": "idle"}
# Frames kept per rank, innermost first (a deep stack's outer frames say nothing of where it waits).
MAX_FRAMES = 12


def rank_env(pid):
    """RANK and LOCAL_RANK from the environment DeepSpeed's launch.py gave the rank."""
    env = dict(x.split(b"=", 1) for x in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in x)
    return {k.lower(): int(env[k.encode()]) for k in ("RANK", "LOCAL_RANK") if env.get(k.encode(), b"").isdigit()}


def state(pid):
    try:
        letter = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return STATES.get(letter, letter)


def frames(dump):
    """The main thread's frames from py-spy's JSON (innermost first): name, file (the short
    name py-spy gives: the path below site-packages), line."""
    threads = json.loads(dump)
    main = next((t for t in threads if t.get("thread_name") == "MainThread"), threads[0] if threads else None)
    if main is None:
        return []
    return [{"name": f["name"], "file": f.get("short_filename") or f.get("filename"), "line": f.get("line")}
            for f in main.get("frames", [])[:MAX_FRAMES]]


def read_stack(py_spy, pid, timeout=30):
    """{frames} or {error} for one process."""
    if not os.access(py_spy, os.X_OK):
        return {"error": f"py-spy is not at {py_spy}: set dsc_py_spy_version and re-run provision.yml "
                         f"(or pip install py-spy into the env)"}
    try:
        r = subprocess.run([py_spy, "dump", "--pid", str(pid), "--json", "--nonblocking"],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"py-spy took more than {timeout} s"}
    if r.returncode != 0:
        lines = [x for x in (r.stderr or r.stdout).splitlines() if x.strip()]
        return {"error": " ".join(lines[:3])[:300] or f"py-spy exited with {r.returncode}"}
    try:
        return {"frames": frames(r.stdout)}
    except (ValueError, KeyError, IndexError) as e:
        return {"error": f"py-spy's output was not read: {e}"[:300]}


def collect(run_dir, run_id, py_spy, node=None):
    """Every rank of the run on this node: {node, time, ranks: [{rank, local_rank, pid, state,
    frames | error}]}, written to the run directory's stacks/ (when it exists) and returned."""
    node = node or socket.gethostname()
    ranks = []
    try:
        found = ranks_of(procs(run_id))
    except Blind as e:
        return {"node": node, "time": round(time.time(), 3), "ranks": [], "error": str(e)}
    for p in found:
        try:
            ids = rank_env(p["pid"])
        except OSError:
            continue  # ended meanwhile
        ranks.append({**ids, "pid": p["pid"], "state": state(p["pid"]), **read_stack(py_spy, p["pid"])})
    report = {"node": node, "time": round(time.time(), 3),
              "ranks": sorted(ranks, key=lambda r: r.get("rank", 1 << 30))}
    run = RunDir(run_dir)
    if os.path.isdir(run_dir):
        (run / RunDir.STACKS).mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(report["time"]))
        path = run / RunDir.STACKS / f"{stamp}-{re.sub(r'[^A-Za-z0-9_.-]', '_', node)}.json"
        write_atomic(path, json.dumps(report) + "\n")
        report["saved"] = str(path)
    return report


# Frames that only pass a call on (decorators, nn.Module's call path): a rank's place is the
# innermost frame that is not one of them.
PASS_THROUGH = {"wrapper", "inner", "_fn", "decorate_context", "__call__", "_call_impl",
                "_wrapped_call_impl", "wrapped_fn", "log_wrapper"}
# A frame where a rank waits for its peers: a collective, point-to-point or barrier as
# torch.distributed and DeepSpeed's comm name them.
WAITING = re.compile(r"all_reduce|allreduce|all_gather|allgather|reduce_scatter|broadcast|barrier|"
                     r"all_to_all|\breduce\b|\bgather\b|\bscatter\b|send|recv|\bwait\b|synchronize")


UNREAD = "stack not read"


def place(rank):
    """Where a rank is, in words: its innermost frame that passes nothing on, 'fn (file:line)';
    its error where py-spy could not read it."""
    if rank.get("error"):
        return f"{UNREAD} ({rank['error']})"
    fs = rank.get("frames") or []
    f = next((f for f in fs if f["name"] not in PASS_THROUGH), fs[0] if fs else None)
    return f"{f['name']} ({f['file']}:{f['line']})" if f else "no Python frame"


def _ranks_text(ranks):
    """[0, 1, 2, 4] -> 'ranks 0-2, 4'; [3] -> 'rank 3'."""
    ranks, spans = sorted(ranks), []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
    return f"{'ranks' if len(ranks) > 1 else 'rank'} {text}"


def _group_line(members, where):
    nodes = sorted({r["node"] for r in members})
    states = sorted({r["state"] for r in members} - {"sleeping", "running"})
    return (f"{_ranks_text([r.get('rank', -1) for r in members])} on {', '.join(nodes)}"
            f"{' (' + ', '.join(states) + ')' if states else ''}"
            f"{': ' if where.startswith(UNREAD) else ' in '}{where}")


def summary(reports):
    """The nodes' collect() reports in a few lines: the odd ranks first (stopped ones before the
    rest), each group with its nodes and state, then the frame most of the others wait in (among
    equal groups, a collective's). A stopped rank is odd wherever it is. E.g. "rank 1 on node2
    (stopped) in forward (run.py:88)", "rank 0 on node1 in all_reduce (...)"."""
    unread = [f"{rep['node']}: stacks not read ({rep['error']})" for rep in reports if rep.get("error")]
    ranks = [dict(r, node=rep["node"]) for rep in reports for r in rep.get("ranks", [])]
    if not ranks:
        return unread + ["no rank of the run is alive on the nodes read"]
    first = lambda rs: min(r.get("rank", 0) for r in rs)  # noqa: E731
    groups = {}
    for r in ranks:
        groups.setdefault(place(r), []).append(r)

    def weight(where):
        going = [r for r in groups[where] if r["state"] != "stopped"]
        return len(going), bool(WAITING.search(where.split(" (")[0])), -first(groups[where])
    main = max(groups, key=weight)
    odd = {}
    for r in ranks:
        if place(r) != main or r["state"] == "stopped":
            odd.setdefault((r["state"] == "stopped", place(r)), []).append(r)
    lines = [_group_line(members, where) for (_, where), members
             in sorted(odd.items(), key=lambda kv: (not kv[0][0], first(kv[1])))]
    common = [r for r in groups[main] if r["state"] != "stopped"]
    return unread + lines + ([_group_line(common, main)] if common else []) + [advice(ranks, main)]


def advice(ranks, main):
    """The fix to try, as preflight's rows give one: for the stopped ranks, the others waiting
    on a rank elsewhere, every rank in one collective, or stacks py-spy could not read."""
    stopped = [r for r in ranks if r["state"] == "stopped"]
    if stopped:
        r = stopped[0]
        return (f"fix: rank {r.get('rank')} on {r['node']} is stopped (SIGSTOP, a debugger, a frozen "
                f"cgroup): kill -CONT {r['pid']} there lets the run go on; stop.yml ends it")
    unread = [r for r in ranks if r.get("error")]
    if unread:
        return f"fix: {unread[0]['error']}"
    odd = sorted({r.get("rank") for r in ranks if place(r) != main})
    if odd and WAITING.search(main.split(" (")[0]):
        return (f"fix: the other ranks wait in {main.split(' (')[0]} for {_ranks_text(odd)}: its stack "
                f"(stacks/ in the run directory) shows what holds it (I/O, a data loader, a hang in "
                f"its own code); stop.yml, then resume.yml from the last checkpoint")
    if not odd and WAITING.search(main.split(" (")[0]):
        return ("fix: every rank waits in the same collective: a peer that left it or a network fault; "
                "NCCL_DEBUG=INFO (dsc_nccl_debug) and preflight.yml's measurements name more")
    return "fix: compare the ranks' stacks in stacks/ in the run directory"


def at_stall(run_dir, run_id, hosts, py_spy, ras=False):
    """When the run stalls (the supervisor's Stall): on GPU nodes (`ras`), NCCL's RAS asked for the
    rank whose collectives are behind (dscnode.ncclras; said as such where it does not answer);
    with `py_spy`, every node's stacks, this one's and the run's other nodes' through pdsh (named
    as the hostfile names them), saved on each node. Their summary, RAS's lines first, printed to
    the launcher log and kept in stalled.json, which status shows."""
    lines = ras_lines() if ras else []
    if py_spy:
        reports = [collect(run_dir, run_id, py_spy, node=hosts[0] if hosts else None)]
        for host, text in on_others(hosts, "stacks", run_dir, run_id, "--py-spy", py_spy).items():
            try:
                reports.append(dict(json.loads(text), node=host))
            except ValueError:
                reports.append({"node": host, "ranks": [], "error": text.strip()[:300]})
        lines += summary(reports)
    print("[dsc_node] where each rank is (stacks/ in the run directory on each node):\n"
          + "\n".join(f"[dsc_node]   {line}" for line in lines), flush=True)
    stalled = RunDir(run_dir) / RunDir.STALLED
    record = read_json(stalled)
    if record is not None:
        write_atomic(stalled, json.dumps(dict(record, stacks=lines)) + "\n")
    return lines


def ras_lines(addr=None):
    """What NCCL's RAS says of the stalled job, from this node (the master's ranks' RAS answers for
    every node): a line per rank behind, missing or in error; one saying all agree, or why RAS gave
    no answer. `addr`: host:port, by default NCCL_RAS_ADDR as the ranks have it, else NCCL's own."""
    host, _, port = (addr or os.environ.get("NCCL_RAS_ADDR") or f":{ncclras.PORT}").rpartition(":")
    host = host or "127.0.0.1"
    where = f"{host}:{port}"
    try:
        verdicts = ncclras.behind(ncclras.ask(host, int(port)))
    except (OSError, ValueError) as e:
        return [f"NCCL RAS: no answer at {where} ({e}): NCCL before 2.24, NCCL_RAS_ENABLE=0, or its "
                f"address elsewhere (NCCL_RAS_ADDR); the stacks alone"]
    return ncclras.said(verdicts) or [f"NCCL RAS ({where}): every rank has launched the same collectives"]
