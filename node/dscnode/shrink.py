"""Continuing on fewer nodes (launch's dsc_min_nodes): when an attempt fails and a node is lost (it
does not answer, its GPUs fail the gate, or its ranks were killed in two attempts in a row), the
master's supervisor drops it and restarts on the others, as long as dsc_min_nodes of them remain:
1. the checkpoint: the newest that every survivor holds complete and of which each lost node's
   part is kept on a survivor (dscnode.copies' ring);
2. every node's part of it is gathered on the master (a survivor's sent by the survivor, a lost
   node's by the node keeping its copy) and DeepSpeed's ds_to_universal converts the whole into a
   universal checkpoint: each parameter's fp32 weights and optimizer state whole, loadable at any
   world size;
3. that universal checkpoint replaces the checkpoint's tag folder on every survivor, marked
   (complete.UNIVERSAL): the entry shim loads a folder so marked with DeepSpeed's load_universal;
4. the next attempt runs without the lost nodes (DeepSpeed's --include, or --exclude), with the
   ds_config the plan wrote for the survivors' world size (shrink.json: the same global batch
   through more gradient accumulation; where it cannot stay exactly, the nearest and why), and
   each node's own settings (DSC_NODE_*, indexed by the node's place among the nodes that run)
   taken for the survivors.
A resume that starts the run on other nodes than it last ran on (a lost node back in the
inventory, or one left out of it: the master too, the next node then the master) converts the
newest checkpoint the same way first, the master's supervisor at its start (regroup).
Where checkpoints go to a directory every node shares (dsc_checkpoint_shared_dir) the newest
marked complete there is converted in place: its parts are all there, and the universal
checkpoint installed once is every survivor's."""
import json
import os
import shutil
import subprocess
import sys
import time

from dscnode import complete
from dscnode.copies import PARTS, checked, helper, part_files, relay, ring, saves, send_folder, shared_save, unpack
from dscnode.procs import on_others
from dscnode.records import continued
from dscnode.rundir import RunDir, append_line, last_line, read_json, read_text, write_atomic

STAGE = ".dsc_universal"  # in the save directory: the gathered parts and the conversion, while it runs
CONVERT_TIMEOUT_S = 4 * 3600.0
WORKERS = 4  # ds_to_universal's --num_extract_workers


class Refused(Exception):
    """Why the run cannot go on on fewer nodes (said in the log; the run then fails as before)."""


def settings(run):
    """shrink.json, as the plan wrote it (dsc_min_nodes set), or None: {min_nodes, nodes (the
    launch's, in the hostfile's order), slots: {node: ranks}, worlds: {world size: {config,
    micro_batch, grad_accum, train_batch, exact, why}}}."""
    found = read_json(run / RunDir.SHRINK)
    return found if isinstance(found, dict) and found.get("min_nodes") else None


def lost_nodes(hosts, held_by, refused, causes=()):
    """The nodes to drop: those that did not answer, those whose GPUs failed the gate
    (gpu_gate's "<node> GPU i: what" findings), and the one whose ranks died (ranks_dead), in the
    hostfile's order."""
    failed = {f.split(" ")[0] for f in refused} | set(ranks_dead(causes))
    return [h for h in hosts if h not in held_by or h in failed]


def ranks_dead(causes):
    """The node whose ranks were killed by a signal (the kernel's out-of-memory killer, a bus
    error, a segfault in a driver) first in the last two attempts both, the restart on every node
    not having helped: [node], else []. `causes` are the supervisor's, an attempt's each (None
    where it failed without one), oldest first. A rank that exits with an error is taken for the
    script's, never the node's: every node would raise it alike; a GPU at fault is the gate's."""
    last = [c for c in causes[-2:] if c]
    if len(last) == 2 and all(c["kind"] == "signal" for c in last) and last[0]["node"] == last[1]["node"]:
        return [last[0]["node"]]
    return []


def convertible(held_by, hosts, lost):
    """The newest tag that every survivor holds complete and of which each lost node's part is kept
    on a survivor, or None."""
    survivors, keeper = [h for h in hosts if h not in lost], ring(hosts)
    for tag in dict.fromkeys(t for h in survivors for t in reversed(held_by[h]["tags"])):
        if all(tag in held_by[h]["tags"] for h in survivors) and all(
                keeper.get(n) in survivors and n in held_by[keeper[n]]["copies"].get(tag, []) for n in lost):
            return tag
    return None


def gather(save_dir, tag, hosts, lost, held_by, here):
    """Every part of the checkpoint `hosts` saved, in one folder on this node (`here`, the master),
    which it returns: its own, each other node's sent by that node, a lost node's by its keeper (a
    copy this node keeps already is taken as it is)."""
    keeper, folder = ring(hosts), checked(save_dir, tag)
    others = [n for n in hosts if n != here]
    for node in others:
        if node in held_by[here]["copies"].get(tag, []):
            continue
        source = keeper[node] if node in lost else node
        got, error = relay(helper(source, here, "part-send", save_dir, tag, *(["--copy-of", node] if node in lost else [])),
                           helper(here, here, "part-receive", save_dir, tag, "--from", node))
        if not got:
            raise Refused(f"{node}'s part of checkpoint {tag} did not reach {here} from {source}: {error}")
    stage = os.path.join(save_dir, STAGE, f"{tag}.parts")
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage, mode=0o750)
    for source in [folder] + [os.path.join(folder, PARTS, n) for n in others]:
        for rel in part_files(source):
            dest = os.path.join(stage, rel)
            if os.path.exists(dest):  # the model states every node's local rank 0 saved alike
                continue
            os.makedirs(os.path.dirname(dest), mode=0o750, exist_ok=True)
            try:
                os.link(os.path.join(source, rel), dest)
            except OSError:
                shutil.copy2(os.path.join(source, rel), dest)
    return stage


def convert(python, stage, out, record):
    """DeepSpeed's ds_to_universal from the gathered parts into `out`, with the files of the tag
    folder that are not DeepSpeed's (train.run's COMPLETE, a script's own) and the mark `record`
    (who was lost, from which world size); its seconds."""
    shutil.rmtree(out, ignore_errors=True)
    started = time.time()
    try:
        r = subprocess.run([python, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", stage,
                            "--output_folder", out, "--inject_missing_state", "--num_extract_workers", str(WORKERS)],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                           timeout=CONVERT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise Refused(f"ds_to_universal did not end within {CONVERT_TIMEOUT_S:.0f} s") from None
    if r.returncode:
        said = (r.stderr.strip() or r.stdout.strip()).splitlines()
        raise Refused(f"ds_to_universal failed (exit code {r.returncode}): {said[-1][:300] if said else ''}")
    for name in os.listdir(stage):
        path = os.path.join(stage, name)
        if (not name.endswith(".pt") and name != "latest" and os.path.isfile(path)
                and not os.path.exists(os.path.join(out, name))):
            shutil.copy2(path, os.path.join(out, name))
    write_atomic(os.path.join(out, complete.UNIVERSAL), json.dumps(record) + "\n")
    return time.time() - started


def install(save_dir, tag, new):
    """The folder `new` becomes the checkpoint's tag folder, marked complete (the one it replaces
    removed: the universal checkpoint holds all of it). The checkpoints marked here after it are
    removed too: each lacks a lost node's part (or it would have been chosen), and a loader that
    takes the newest complete here (train.run's, the shim's agreed tag) must take this one."""
    folder = checked(save_dir, tag)
    marked = complete.tags(save_dir) or []
    for newer in marked[marked.index(tag) + 1:] if tag in marked else []:
        shutil.rmtree(checked(save_dir, newer), ignore_errors=True)
    old = os.path.join(save_dir, STAGE, f"{tag}.replaced.{os.getpid()}")
    if os.path.isdir(folder):
        os.rename(folder, old)
    os.rename(new, folder)
    shutil.rmtree(old, ignore_errors=True)
    complete.mark(save_dir, tag)


def send_universal(save_dir, tag, out=None):
    """The universal checkpoint this node (the master) converted, as a tar stream (copies.send's)."""
    checked(save_dir, tag)
    send_folder(os.path.join(save_dir, STAGE, tag), out)


def receive_universal(save_dir, tag, inp=None):
    """Install the universal checkpoint a tar stream holds as the checkpoint's tag folder here.
    Prints {files, bytes}."""
    checked(save_dir, tag)
    tmp = os.path.join(save_dir, STAGE, f"{tag}.{os.getpid()}")
    os.makedirs(os.path.dirname(tmp), mode=0o750, exist_ok=True)
    try:
        files, size = unpack(inp or sys.stdin.buffer, tmp)
        if not os.path.isfile(os.path.join(tmp, complete.UNIVERSAL)):
            raise SystemExit("dsc_node: the stream holds no universal checkpoint (no mark)")
        install(save_dir, tag, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"files": files, "bytes": size}), flush=True)


def without(cmd, lost):
    """The DeepSpeed launcher's command without the lost nodes: dropped from its --include, or
    named in an --exclude."""
    cmd = list(cmd)
    if "--include" in cmd:
        at = cmd.index("--include") + 1
        cmd[at] = "@".join(spec for spec in cmd[at].split("@") if spec.split(":")[0] not in lost)
    elif "--exclude" in cmd:
        at = cmd.index("--exclude") + 1
        cmd[at] = "@".join([cmd[at], *lost])
    else:
        cmd[1:1] = ["--exclude", "@".join(lost)]
    return cmd


def node_env(text, hosts, survivors):
    """.deepspeed_env with each DSC_NODE_<VAR>'s values ("<node 0's>/<node 1's>/...", in the
    hostfile's order) taken for the survivors alone: a rank takes the value at its node's place
    among the nodes that run (CROSS_RANK)."""
    keep = [hosts.index(s) for s in survivors]
    lines = []
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.startswith("DSC_NODE_"):
            values = value.split("/")
            value = "/".join(values[i] if i < len(values) else "" for i in keep)
        lines.append(f"{key}{sep}{value}")
    return "\n".join(lines) + "\n"


def command_for(run, cmd, nodes, env):
    """The launch's command `cmd` for `nodes` (the master first) of the launch's (shrink.json's):
    the others left out (without), the ds_config of their world size, and the ranks' environment
    for them (`env`, the attempts', changed in place: DS_ENV_FILE). Returns (command, world
    size's batch); raises Refused where the plan wrote none for that world size."""
    found = settings(run) or {}
    launched = found.get("nodes") or []
    world = sum(int(found.get("slots", {}).get(n, 0)) for n in nodes)
    batch = (found.get("worlds") or {}).get(str(world))
    if not batch or not set(nodes) <= set(launched):
        raise Refused(f"the plan holds no configuration for {world} ranks on {', '.join(nodes)}")
    write_atomic(run / RunDir.SHRUNK_ENV, node_env(read_text(run / RunDir.DS_ENV), launched, nodes))
    env["DS_ENV_FILE"] = str(run / RunDir.SHRUNK_ENV)
    launch_config, config = str(run / RunDir.DS_CONFIG), str(run / batch["config"])
    left_out = [n for n in launched if n not in nodes]
    return [config if arg == launch_config else arg for arg in (without(cmd, left_out) if left_out else cmd)], dict(batch, world=world)


def regroup(run, cmd, source, nodes, held_by, env, lost_at=None):
    """Go on with `nodes` (the master first) from the newest checkpoint that `source` saved (the
    nodes the run ran on): the nodes of `source` not among them are lost (their parts taken from
    their copies), those not in `source` taken in again. The checkpoint converted (ds_to_universal)
    and installed on each of `nodes`, then the launch's command `cmd` for them (command_for).
    Returns the command; raises Refused. `held_by`: what each node of `source` holds (copies.survey)."""
    found = settings(run) or {}
    lost, back = [n for n in source if n not in nodes], [n for n in nodes if n not in source]
    if len(nodes) < found.get("min_nodes", len(source)):
        raise Refused(f"{len(nodes)} of {len(found.get('nodes') or source)} nodes are left and dsc_min_nodes is "
                      f"{found.get('min_nodes')}")
    silent = [n for n in source if n in nodes and n not in held_by]
    if silent:
        raise Refused(f"{', '.join(silent)} did not answer")
    command, batch = command_for(run, cmd, nodes, env)
    recorded = saves(run)
    step = tag = None
    if recorded:
        save_dir, here = recorded[-1]["save_dir"], nodes[0]
        # A shared directory (dsc_checkpoint_shared_dir) holds every part of a checkpoint once:
        # nothing to gather, and the universal checkpoint installed here is every node's.
        shared = shared_save(recorded[-1])
        tag = (complete.tags(checked(save_dir)) or [None])[-1] if shared else convertible(held_by, source, lost)
        if tag is None:
            raise Refused(f"no checkpoint in {save_dir} is " + ("marked complete" if shared else
                          f"complete on {', '.join(n for n in source if n not in lost)}"
                          + (f" with a copy of {', '.join(lost)}'s part on one of them" if lost else "")))
        started = time.time()
        stage = checked(save_dir, tag) if shared else gather(save_dir, tag, source, lost, held_by, here)
        out = os.path.join(save_dir, STAGE, tag)
        python = os.path.join(os.path.dirname(cmd[0]), "python")
        seconds = convert(python, stage, out, {"tag": tag, "from": source, "to": nodes, "lost": lost})
        if not shared:
            shutil.rmtree(stage, ignore_errors=True)
        for node in [] if shared else nodes[1:]:
            got, error = relay(helper(here, here, "universal-send", save_dir, tag),
                               helper(node, here, "universal-receive", save_dir, tag))
            if not got:
                raise Refused(f"the universal checkpoint did not reach {node}: {error}")
        install(save_dir, tag, out)
        step = next((s.get("step") for s in reversed(recorded) if s["tag"] == tag), None)
        print(f"[dsc_node] checkpoint {tag} converted for {batch['world']} ranks (ds_to_universal {seconds:.1f} s, "
              f"{time.time() - started:.1f} s with gathering and sending)", flush=True)
    record = {"time": round(time.time(), 1), "lost": lost, "back": back, "nodes": nodes,
              "of": len(found.get("nodes") or source), "at_step": lost_at, "checkpoint": tag, "from_step": step,
              **{k: batch.get(k) for k in ("world", "micro_batch", "grad_accum", "train_batch", "exact", "why")}}
    append_line(run / RunDir.SHRINKS, json.dumps(record))
    on_others(nodes, "write-shrink", str(run.path), json.dumps(record))  # a later master reads it there
    print(f"[dsc_node] {continued(record)}", flush=True)
    return command


def ran_on(run, launched):
    """The nodes the run ran on last: the last regroup's (SHRINKS), else the launch's."""
    done = last_line(run / RunDir.SHRINKS) or {}
    return done.get("nodes") if isinstance(done.get("nodes"), list) else list(launched)
