"""The node helper: everything the playbooks ask of a node, standard library only (Python 3.10+).

The nodes run it as one file built from this package (build.py): dsc_node.pyz, installed
root-owned at INSTALLED_PATH by provision.yml and pushed as it is for the probe before anything is
installed. The node's system python3 runs every action (cli.py); each rank's env python runs the
entry shim (entry.py), which imports rundir.py and ranktimes.py and nothing else of the package, and provision's
warm-up (warm.py).

    rundir.py      the run directory's layout (RunDir), its secrets, atomic writes, reads that follow no link
    entry.py       the entry shim: the run's secrets, DeepSpeed's engine watched and its JIT op builds recorded, the user's script
    complete.py    checkpoints complete on every node: the shim's marks after each save, the tag a load agrees on
    copies.py      each node's part of a node-local checkpoint kept on the next node, and put back from there
    shrink.py      dsc_min_nodes: a lost node dropped at the restart, its checkpoint converted (ds_to_universal) for the survivors
    ranktimes.py   each rank's time in DeepSpeed's collectives against its steps, gathered every window (the shim installs it)
    stragglers.py  which rank the others wait for, judged from those windows (the supervisor's slow-rank mark)
    procs.py       a run's processes (found, signalled, stopped), pid files, op-build locks
    records.py     what a run recorded: status, runs table, history, log tail, memory, step downs
    probe.py       what the plan needs from a node, read-only
    warm.py        provision's one torch import (none where its record answers): what torch sees, DeepSpeed's ops warmed or awaited, the versions
    ufw.py         cluster_network's ufw deletions and insertions, one call per node
    checks.py      preflight's node checks, the ssh mesh, the master port held and reached
    launch.py      write-run and start (under the run root's lock)
    supervisor.py  the detached supervisor: watch, tear down, restart, step down, record the exit
    stacks.py      where each rank is (py-spy), read at a stall or on demand, and their summary
    ncclras.py     NCCL's RAS asked at a stall on GPU nodes: the rank whose collectives are behind
    gpuhealth.py   the GPU gate: a node's GPUs judged before a launch or a restart
    nccllog.py     which transport NCCL chose, from its INFO lines (preflight's all-reduce, status during training)
    pairs.py       every pair of nodes once, in rounds (doctor.yml)
    safe.py        what may reach a command line on the nodes
    cli.py         the command line: one sub-command per action, each printing one JSON object
    build.py       the built file (on the control node; not part of it)
"""
import hashlib
import os

# Where provision.yml installs the built helper on every node (root-owned; the plan reads it from here).
INSTALLED_PATH = "/usr/local/lib/dscluster/dsc_node.pyz"
# Root's own directory on every node (root-owned, no other user writes it): what root installs from
# into an env that is not the training user's (packages/: the lock and the wheelhouse), and what
# root keeps of the training user's work (warm/: the last op warm-up's answer for each JIT cache).
# Root never installs from, runs or trusts a file another user can write.
ROOT_STATE = "/var/lib/dscluster"
ROOT_PACKAGES = f"{ROOT_STATE}/packages"
WARM_RECORDS = f"{ROOT_STATE}/warm"


def warm_record(ext_dir):
    """Root's record of the last complete op warm-up for the JIT cache `ext_dir` (an install root's:
    one record each, so that provisions of two install roots on a node leave each other's be)."""
    return f"{WARM_RECORDS}/{hashlib.sha256(str(ext_dir).encode()).hexdigest()[:16]}.json"


def program():
    """The file this helper runs from, the built one that holds this package (at INSTALLED_PATH on
    a node): what pdsh runs on the run's other nodes."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
