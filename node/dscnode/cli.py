"""The node helper's command line. Installed by provision.yml on every node at
/usr/local/lib/dscluster/dsc_node.pyz (root-owned, built from this package) and run under the
node's system python3; `probe` also runs before provisioning (Ansible's script module pushes the
built file). Every command prints one JSON object.

    dsc_node.pyz probe [--run-root DIR]        # GPUs, interfaces, InfiniBand, CPUs, runs (the plan's input)
    dsc_node.pyz check                         # preflight: env, versions, names, disk, ports, firewall
                                               #   (arguments as JSON in $DSC_PREFLIGHT, as for the three below)
    dsc_node.pyz mesh                          # from the master, as the training user: ssh to every node, clocks
    dsc_node.pyz listen | connect              # hold / reach the master port (preflight's TCP check)
    dsc_node.pyz iperf-server                  # a one-shot iperf3 server of ours, or who holds its port
    dsc_node.pyz write-run RUN_DIR [--resume]  # stdin {files: {name: text}, code: base64 tar.gz}: the run's files
    dsc_node.pyz start RUN_DIR RUN_ID --run-root DIR (--ports FIRST LAST | --port P) [--replace]
                       [--hosts H1,H2] [--max-restarts N] [--backoff S] [--resume-args JSON_LIST]
                       [--stall-s S] [--stall-fail] [--py-spy PATH] [--foreground [--attempt N]]
                       [--used-gpus JSON] [--no-copies] [--agreed JSON] -- CMD...
                                               # under a lock: refuse (or replace) an active run, take the
                                               # first free master port (--port: the one the master took,
                                               # no_ssh mode's other nodes), detach a supervisor that runs CMD,
                                               # tears the run down everywhere when a node fails and
                                               # restarts it from its checkpoint (opt-in)
    dsc_node.pyz gpu-health [--gpus JSON]      # this node's GPUs judged: the supervisor's gate before
                                               #   a restart (null without nvidia-smi)
    dsc_node.pyz matches GLOB --cwd DIR        # a {latest:GLOB}'s matches here and what each holds of a
                                               #   finished save (the supervisor's pick on every node)
    dsc_node.pyz latest-states GLOB... --cwd DIR [--node NAME]
                                               # this node's matches of each glob as one line for
    dsc_node.pyz agree-latest --nodes N        #   this, which reads every node's on stdin: {glob: the
                                               #   newest complete on all} (no_ssh and slurm's start)
    dsc_node.pyz part-send SAVE_DIR TAG [--copy-of NODE]
                                               # this node's part of a node-local checkpoint (or its copy
                                               #   of NODE's) as a tar stream: the supervisor pipes it
    dsc_node.pyz part-receive SAVE_DIR TAG [--from NODE]
                                               #   into this on the node that keeps it (dscnode.copies)
    dsc_node.pyz part-held SAVE_DIR            # the checkpoints complete here and the copies kept here
    dsc_node.pyz shared-dir DIR (--mark | --seen TOKEN | --unmark TOKEN)
                                               # dsc_checkpoint_shared_dir: the master's mark, found (or
                                               #   not) on every node before a start, removed
    dsc_node.pyz universal-send SAVE_DIR TAG   # the universal checkpoint converted here (dscnode.shrink)
    dsc_node.pyz universal-receive SAVE_DIR TAG  # installed as the tag folder here, from stdin
    dsc_node.pyz procs RUN_ID                  # processes that carry DSC_RUN_ID=RUN_ID
    dsc_node.pyz stop RUN_ID [--grace S] [--run-dir DIR [--by WHO]] [--ext-dir DIR]
                                               # mark the run stopped (by WHO), TERM, then KILL after
                                               # S seconds
    dsc_node.pyz status RUN_DIR RUN_ID [--hosts H1,H2] [--wait S]
                                               # state, ranks alive, last metrics, first error
                                               # (with --hosts: every node's state and ranks, via pdsh;
                                               # with --wait: after up to S seconds, at once when the
                                               # run ends: a followed run's poll)
    dsc_node.pyz stacks RUN_DIR RUN_ID --py-spy PATH [--node NAME]
                                               # every rank's Python stack here (as the training
                                               # user), saved in RUN_DIR/stacks/
    dsc_node.pyz write-exit RUN_DIR CODE       # the run's exit code, recorded on a worker
    dsc_node.pyz write-shrink RUN_DIR RECORD   # a regroup (shrinks.jsonl's line), recorded on a worker
    dsc_node.pyz files RUN_DIR                 # the run's files but code and checkpoints (logs.yml)
    dsc_node.pyz log RUN_DIR RUN_ID [--lines N] [--hosts H1,H2] [--wait S]
                                               # the log's last N lines per node, its raw tail, the state
    dsc_node.pyz history RUN_DIR               # every logged step (metrics or progress), for plots
    dsc_node.pyz runs RUN_ROOT                 # every run, newest first, with its state (runs.yml)
    dsc_node.pyz free-port FIRST LAST          # the first port nobody listens on (exit 3 if none)
    dsc_node.pyz active RUN_ROOT               # the run whose supervisor is alive, if any
    dsc_node.pyz write-secrets RUN_DIR         # stdin {NAME: value}: the run's secrets, 0600, outside the run dir
    dsc_node.pyz ufw-apply                     # stdin {delete, insert}: cluster_network's ufw changes (root)
    dsc_node.pyz warm --ops A,B --report FILE --gpus N [--record FILE] [--driver V] [--build]
                                               # provision, in the env's python as the training user:
                                               # what torch sees, DeepSpeed's ops warmed (or left for
                                               # the kind's source to ship, without --build), versions
    dsc_node.pyz entry --script FILE | --module NAME [ARGS...]
                                               # each rank: the run's secrets into the environment,
                                               # DeepSpeed's engine watched for progress, then the
                                               # user's script or module in this process

Each action imports its own modules when it runs: every rank starts through `entry`, which loads
the shim alone (entry.py), without argparse or the rest of the package.
"""
import json
import os
import sys

PROG = "dsc_node.pyz"


def main(argv):
    # What the toolkit writes on a node (run files, logs, checkpoints: every rank starts through
    # this helper's entry shim) is the training user's and root's alone on a shared machine.
    os.umask(0o027)
    # DeepSpeed's launcher: `python -u dsc_node.pyz --local_rank=N entry ...` (unless --no_local_rank)
    local_rank = argv[:1] if argv and argv[0].startswith("--local_rank=") else []
    argv = argv[len(local_rank):]
    if argv[:1] == ["entry"]:  # its arguments are the user's program's: the shim reads them itself
        from dscnode.entry import entry
        return entry(argv[1:], local_rank)
    if not argv:
        print(__doc__)
        return 2
    from dscnode.procs import Blind
    cmd = None
    if argv[0] == "start" and "--" in argv:  # its command as it is, options and all (the launcher's)
        argv, cmd = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser().parse_args(argv)
    args.cmd = cmd
    try:
        return args.run(args) or 0
    except Blind as e:
        print(json.dumps({"error": str(e)}))
        return 5


WAIT_HELP = "first wait up to S seconds while the run runs on this node (a followed run's poll)"


def start_arguments(p):
    p.add_argument("run_dir")
    p.add_argument("run_id")
    p.add_argument("--run-root", required=True)
    ports = p.add_mutually_exclusive_group(required=True)
    ports.add_argument("--ports", nargs=2, type=int, metavar=("FIRST", "LAST"))
    ports.add_argument("--port", type=int)
    p.add_argument("--replace", action="store_true")
    p.add_argument("--hosts", default="")
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--backoff", type=float, default=10.0)
    p.add_argument("--resume-args", default='["--resume"]')
    p.add_argument("--stall-s", type=float, default=0.0)
    p.add_argument("--stall-fail", action="store_true")
    p.add_argument("--py-spy", default="", help="the env's py-spy: every node's stacks are read at a stall")
    p.add_argument("--foreground", action="store_true", help="supervise in this process (Slurm's task on a node)")
    p.add_argument("--attempt", type=int, default=0, help="the Slurm batch job's restart: resume from the checkpoint")
    p.add_argument("--used-gpus", default="{}", help="JSON {node: GPU indices}: what the GPU gate judges before a restart")
    p.add_argument("--no-copies", action="store_true", help="keep no copy of each node's checkpoint part on "
                                                             "another node (dscnode.copies)")
    p.add_argument("--agreed", default="", help="agree-latest's JSON: what every node agreed each {latest:GLOB} "
                                                "is, where no supervisor reaches the others")


def parser():
    """Every action's arguments as the roles and the supervisor pass them; each action's function
    (below) prints its JSON and returns the exit code (None: 0)."""
    import argparse
    top = argparse.ArgumentParser(prog=PROG, description=__doc__, allow_abbrev=False,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = top.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(name, run, summary):
        sub = actions.add_parser(name, help=summary, description=summary, allow_abbrev=False)
        sub.set_defaults(run=run)
        return sub

    p = action("probe", _probe, "what the plan needs from this node (read-only)")
    for option in ("--run-root", "--install-root", "--data-dir", "--train-user", "--existing-python"):
        p.add_argument(option, default="")
    p.add_argument("--slurm", action="store_true", help="also Slurm's partitions, their nodes and the queue (sinfo, squeue)")
    for name in ("check", "mesh", "listen", "connect", "iperf-server"):
        action(name, _preflight, f"preflight's {name} (arguments as JSON in $DSC_PREFLIGHT)")
    p = action("write-run", _write_run, "stdin {files, code, code_dest}: the run's files and code")
    p.add_argument("run_dir")
    p.add_argument("--resume", action="store_true")
    start_arguments(action("start", _start, "under the run root's lock: take a master port, detach a "
                                            "supervisor that runs the command after --"))
    p = action("gpu-health", _gpu_health, "this node's GPUs judged (the gate before a restart)")
    p.add_argument("--gpus", default="null", help="JSON list: the indices the run uses (a fault elsewhere only "
                                                  "warns); null: every GPU")
    p = action("matches", _matches, "a {latest:GLOB}'s matches here, newest first, with what each holds of "
                                    "a finished save (the supervisor's newest complete on every node)")
    p.add_argument("pattern")
    p.add_argument("--cwd", required=True)
    p = action("latest-states", _latest_states, "each glob's matches here as one line of this node's, for "
                                                "agree-latest (where no supervisor reaches the other nodes)")
    p.add_argument("patterns", nargs="+")
    p.add_argument("--cwd", required=True)
    p.add_argument("--node", default="", help="this node's name in the inventory (default: Slurm's, else the host name)")
    p = action("agree-latest", _agree_latest, "every node's latest-states lines on stdin: {glob: {path: the "
                                              "newest match complete on all of them, said: why}}")
    p.add_argument("--nodes", type=int, required=True, help="how many nodes the run starts on: each must have said")
    p = action("part-send", _part_send, "this node's part of a node-local checkpoint (or, with --copy-of, "
                                        "its copy of that node's part) as a tar stream on stdout")
    p.add_argument("save_dir")
    p.add_argument("tag")
    p.add_argument("--copy-of")
    p = action("part-receive", _part_receive, "keep the part a tar stream on stdin holds: as the copy of "
                                              "--from's part, or as this node's own part, put back")
    p.add_argument("save_dir")
    p.add_argument("tag")
    p.add_argument("--from", dest="from_node")
    p = action("part-held", _part_held, "the checkpoints of a save directory marked complete here, and "
                                        "the other nodes' parts kept here")
    p.add_argument("save_dir")
    p = action("shared-dir", _shared_dir, "dsc_checkpoint_shared_dir before a start: write a mark in it (the "
                                          "master), say whether this node sees it, remove it")
    p.add_argument("folder")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--mark", action="store_true")
    which.add_argument("--seen", default="")
    which.add_argument("--unmark", default="")
    p = action("universal-send", _universal_send, "the universal checkpoint converted here (continuing on fewer "
                                                  "nodes) as a tar stream on stdout")
    p.add_argument("save_dir")
    p.add_argument("tag")
    p = action("universal-receive", _universal_receive, "install the universal checkpoint a tar stream on stdin "
                                                        "holds as the checkpoint's tag folder here")
    p.add_argument("save_dir")
    p.add_argument("tag")
    p = action("procs", _procs, "the processes that carry DSC_RUN_ID=RUN_ID")
    p.add_argument("run_id")
    p = action("stop", _stop, "mark the run stopped, TERM its processes, KILL them after the grace")
    p.add_argument("run_id")
    p.add_argument("--grace", type=float, default=15.0)
    p.add_argument("--run-dir")
    p.add_argument("--ext-dir")
    p.add_argument("--by")
    p = action("status", _status, "the run's state on this node (with --hosts: every node's)")
    p.add_argument("run_dir")
    p.add_argument("run_id")
    p.add_argument("--hosts", default="")
    p.add_argument("--wait", type=float, default=0.0, metavar="S", help=WAIT_HELP)
    p = action("stacks", _stacks, "every rank's Python stack on this node (py-spy), saved in the run directory")
    p.add_argument("run_dir")
    p.add_argument("run_id")
    p.add_argument("--py-spy", required=True)
    p.add_argument("--node", default=None)
    p = action("write-exit", _write_exit, "the run's exit code, recorded on a worker")
    p.add_argument("run_dir")
    p.add_argument("code", type=int)
    p = action("write-shrink", _write_shrink, "a regroup of the run (dsc_min_nodes), recorded on a node it goes on with")
    p.add_argument("run_dir")
    p.add_argument("record", help="the master's line of shrinks.jsonl")
    p = action("files", _files, "the run's files but its code and checkpoints")
    p.add_argument("run_dir")
    p = action("log", _log, "the log's last lines per node, its raw tail, the state")
    p.add_argument("run_dir")
    p.add_argument("run_id")
    p.add_argument("--lines", type=int, default=20)
    p.add_argument("--hosts", default="")
    p.add_argument("--wait", type=float, default=0.0, metavar="S", help=WAIT_HELP)
    p = action("history", _history, "every logged step of the run")
    p.add_argument("run_dir")
    p = action("runs", _runs, "every run under the run root, newest first")
    p.add_argument("run_root")
    p = action("free-port", _free_port, "the first port nobody listens on (exit 3 if none)")
    p.add_argument("first", type=int)
    p.add_argument("last", type=int)
    action("active", _active, "the run whose supervisor is alive, if any").add_argument("run_root")
    action("write-secrets", _write_secrets, "stdin {NAME: value}: the run's secrets, 0600, beside it").add_argument("run_dir")
    action("ufw-apply", _ufw_apply, "stdin {delete, insert}: cluster_network's ufw changes, one call (root)")
    p = action("warm", _warm, "what torch sees, DeepSpeed's ops warmed, the versions (the env's python)")
    for option in ("--ops", "--report", "--record", "--driver"):
        p.add_argument(option, default="")
    p.add_argument("--gpus", type=int, default=0)
    p.add_argument("--build", action="store_true")
    action("entry", None, "each rank: --script FILE | --module NAME [ARGS...] (read by the shim itself)")
    return top


def hosts(text):
    return [h for h in text.split(",") if h]


def _warm(a):
    from dscnode.warm import warm
    print(json.dumps(warm([o for o in a.ops.split(",") if o], a.report, a.gpus, a.build, a.record, a.driver)))


def _probe(a):
    from dscnode.probe import probe
    print(json.dumps(probe(run_root=a.run_root, existing=a.existing_python, install_root=a.install_root,
                           data_dir=a.data_dir, train_user=a.train_user, slurm=a.slurm)))


def _preflight(a):
    from dscnode import checks
    run = {"check": checks.check, "mesh": checks.mesh, "listen": checks.listen, "connect": checks.connect,
           "iperf-server": checks.iperf_server}
    print(json.dumps(run[a.action](json.loads(os.environ.get("DSC_PREFLIGHT", "{}")))))


def allowed_globs(action, patterns):
    """Refuse, before any file is looked at, a glob that {latest:GLOB} would not take (it leaves
    the code directory, holds shell characters or a newline)."""
    from dscnode.safe import latest_glob
    for pattern in patterns:
        if latest_glob("{latest:" + pattern + "}") != pattern:
            raise SystemExit(f"dsc_node {action}: {pattern!r} is not a glob {{latest:GLOB}} allows")


def _matches(a):
    from dscnode.supervisor import match_states
    allowed_globs("matches", [a.pattern])
    print(json.dumps(match_states(a.pattern, a.cwd)))


def _latest_states(a):
    from dscnode.supervisor import latest_states
    allowed_globs("latest-states", a.patterns)
    print(json.dumps(latest_states(a.patterns, a.cwd, a.node)))


def _agree_latest(a):
    from dscnode.supervisor import agree_latest
    lines = sys.stdin.read(1 << 24).splitlines()
    agreed, nodes = agree_latest(lines)
    if len(nodes) < a.nodes:  # an agreement without a node could take a checkpoint it lacks
        print(f"{PROG} agree-latest: {len(nodes)} node(s) said what they hold ({', '.join(nodes) or 'none'}) "
              f"in {len(lines)} line(s) of input, of the {a.nodes} the run starts on", file=sys.stderr)
        return 1
    print(json.dumps(agreed))


def _part_send(a):
    from dscnode.copies import send
    send(a.save_dir, a.tag, a.copy_of)


def _part_receive(a):
    from dscnode.copies import receive
    receive(a.save_dir, a.tag, a.from_node)


def _part_held(a):
    from dscnode.copies import checked, held
    checked(a.save_dir)
    print(json.dumps(held(a.save_dir)))


def _shared_dir(a):
    from dscnode.copies import shared_dir
    print(json.dumps(shared_dir(a.folder, mark=a.mark, seen=a.seen, unmark=a.unmark)))


def _universal_send(a):
    from dscnode.shrink import send_universal
    send_universal(a.save_dir, a.tag)


def _universal_receive(a):
    from dscnode.shrink import receive_universal
    receive_universal(a.save_dir, a.tag)


def _gpu_health(a):
    from dscnode.gpuhealth import report
    print(json.dumps(report(json.loads(a.gpus))))


def _write_run(a):
    from dscnode.launch import write_run
    result = write_run(a.run_dir, json.load(sys.stdin), resume=a.resume)
    print(json.dumps(result))
    return 0 if result["ok"] else 4


def agreed_latest(text):
    """start's --agreed: agree-latest's {glob: {path, said}} (a path the supervisor checks is one
    of its own matches), None where there is none or it is not that (each node resolves alone)."""
    try:
        agreed = json.loads(text) if text else None
    except ValueError:
        return None
    ok = isinstance(agreed, dict) and all(
        isinstance(v, dict) and isinstance(v.get("path"), str) and isinstance(v.get("said"), str)
        for v in agreed.values())
    return agreed if ok else None


def _start(a):
    from dscnode.launch import start
    if not a.cmd:
        print(f"{PROG} start: the command to run comes after --", file=sys.stderr)
        return 2
    return start(a.run_dir, a.run_id, a.cmd, a.run_root, tuple(a.ports) if a.ports else None,
                 replace=a.replace, hosts=hosts(a.hosts), max_restarts=a.max_restarts,
                 backoff=a.backoff, resume_args=json.loads(a.resume_args),
                 stall={"timeout_s": a.stall_s, "fail": a.stall_fail, "py_spy": a.py_spy}, port=a.port,
                 foreground=a.foreground, attempt=a.attempt, used_gpus=json.loads(a.used_gpus),
                 copies=not a.no_copies, agreed=agreed_latest(a.agreed))


def _procs(a):
    from dscnode.procs import procs
    print(json.dumps(procs(a.run_id)))


def _stop(a):
    from dscnode.procs import stop
    print(json.dumps(stop(a.run_id, a.grace, a.run_dir, a.ext_dir, a.by)))


def _status(a):
    from dscnode.probe import rdma
    from dscnode.records import node_states, status, wait_for_end
    wait_for_end(a.run_dir, a.wait)
    st = status(a.run_dir, a.run_id, rdma())
    if a.hosts:
        st["nodes"] = node_states(a.run_dir, a.run_id, a.hosts.split(","), st)
    print(json.dumps(st))


def _stacks(a):
    from dscnode.stacks import collect
    print(json.dumps(collect(a.run_dir, a.run_id, a.py_spy, a.node)))


def _write_exit(a):
    """The supervisor's record of how the run ended, on a worker."""
    from dscnode.rundir import RunDir, write_atomic
    if os.path.isdir(a.run_dir):
        write_atomic(RunDir(a.run_dir) / RunDir.EXIT, f"{a.code}\n")


def _write_shrink(a):
    """The master's record of a regroup, on the other nodes it goes on with: whichever of them is
    the master at a later resume knows which nodes the run last ran on (dscnode.shrink.ran_on)."""
    from dscnode.rundir import RunDir, append_line
    record = json.loads(a.record)
    if os.path.isdir(a.run_dir) and isinstance(record, dict) and isinstance(record.get("nodes"), list):
        append_line(RunDir(a.run_dir) / RunDir.SHRINKS, json.dumps(record))


def _files(a):
    from dscnode.records import run_files
    print(json.dumps(run_files(a.run_dir)))


def _log(a):
    from dscnode.records import log_tail, wait_for_end
    wait_for_end(a.run_dir, a.wait)
    print(json.dumps(log_tail(a.run_dir, a.run_id, a.lines, hosts(a.hosts))))


def _history(a):
    from dscnode.records import history
    print(json.dumps(history(a.run_dir)))


def _runs(a):
    from dscnode.records import runs_table
    print(json.dumps(runs_table(a.run_root)))


def _free_port(a):
    from dscnode.checks import free_port
    port = free_port(a.first, a.last)
    if port is None:
        print(f"every master port from {a.first} to {a.last} is in use", file=sys.stderr)
        return 3
    print(port)


def _active(a):
    from dscnode.procs import active
    print(json.dumps(active(a.run_root)))


def _ufw_apply(a):
    from dscnode.ufw import apply
    result = apply(json.load(sys.stdin))
    print(json.dumps(result))
    return 0 if result["ok"] else 4


def _write_secrets(a):
    from dscnode.rundir import write_secrets
    print(json.dumps(write_secrets(a.run_dir, json.load(sys.stdin))))
