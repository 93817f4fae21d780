"""dscnode.shrink, the supervisor's side of dsc_min_nodes: which nodes are lost, which checkpoint
can be converted without them, the parts gathered on the master, the universal checkpoint sent
and installed through the built node helper, and the survivors' command and environment. The
conversion itself (DeepSpeed's ds_to_universal) and the loss after loading are the local tier's
(tests/local/test_train.py); the whole restart on a cluster is the container tier's
(molecule/tests/test_faults.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dscnode import complete, copies, records, shrink
from dscnode.rundir import RunDir
from tests.unit.node_helpers import HELPER
from tests.unit.test_copies import part, tree

HOSTS = ["node1", "node2", "node3"]


def held(tags, copies_of=None):
    return {"tags": tags, "copies": copies_of or {}}


def test_a_node_that_does_not_answer_or_fails_the_gpu_gate_is_lost():
    answered = {"node1": held([]), "node3": held([])}
    assert shrink.lost_nodes(HOSTS, answered, []) == ["node2"]
    everyone = dict(answered, node2=held([]))
    assert shrink.lost_nodes(HOSTS, everyone, ["node3 GPU 1: Xid 79 (fallen off the bus)"]) == ["node3"]
    assert shrink.lost_nodes(HOSTS, everyone, []) == []


def test_a_node_whose_ranks_are_killed_in_two_attempts_in_a_row_is_lost_an_error_or_one_kill_is_not():
    everyone = {h: held([]) for h in HOSTS}

    def died(node, kind="signal"):
        return {"node": node, "kind": kind, "code": -9 if kind == "signal" else 1}

    assert shrink.lost_nodes(HOSTS, everyone, [], [died("node2"), died("node2")]) == ["node2"]
    assert shrink.lost_nodes(HOSTS, everyone, [], [died("node3"), None, died("node2"), died("node2")]) == ["node2"]
    # once: the restart on every node comes first; two nodes in turn: neither is the node's fault
    assert shrink.lost_nodes(HOSTS, everyone, [], [died("node2")]) == []
    assert shrink.lost_nodes(HOSTS, everyone, [], [died("node2"), died("node3")]) == []
    assert shrink.lost_nodes(HOSTS, everyone, [], [died("node2"), None]) == []
    # a rank's error is the script's, raised on any node alike; a lost connection is the survey's
    assert shrink.lost_nodes(HOSTS, everyone, [], [died("node1", "exit"), died("node1", "exit")]) == []
    assert shrink.lost_nodes(HOSTS, everyone, [], [died("node2", "lost"), died("node2", "lost")]) == []


def test_the_checkpoint_taken_is_the_newest_the_survivors_hold_with_the_lost_part_kept_on_one_of_them():
    # node2 is lost; its keeper in the ring is node3
    by = {"node1": held(["s5", "s10", "s15"]),
          "node3": held(["s5", "s10", "s15"], {"s5": ["node2"], "s10": ["node2"]})}
    assert shrink.convertible(by, HOSTS, ["node2"]) == "s10"  # s15's copy never reached node3
    by["node3"]["copies"]["s15"] = ["node2"]
    assert shrink.convertible(by, HOSTS, ["node2"]) == "s15"
    by["node1"]["tags"] = ["s5", "s10"]  # a survivor without s15: the newest they all hold
    assert shrink.convertible(by, HOSTS, ["node2"]) == "s10"
    # node3 lost: its keeper is the master; node2 and node3 lost: node3's keeper went with it
    assert shrink.convertible({"node1": held(["s5"]), "node2": held(["s5"])}, HOSTS, ["node3"]) is None
    assert shrink.convertible({"node1": held(["s5"], {"s5": ["node3"]}), "node2": held(["s5"])},
                              HOSTS, ["node3"]) == "s5"
    assert shrink.convertible({"node1": held(["s5"], {"s5": ["node3"]})}, HOSTS, ["node2", "node3"]) is None


def test_the_parts_gathered_on_the_master_make_one_checkpoint_the_model_states_once(tmp_path):
    save = tmp_path / "ckpt"
    mine = {"mp_rank_00_model_states.pt": b"model", "zero_pp_rank_0_mp_rank_00_optim_states.pt": b"r0",
            "COMPLETE": b"{}"}
    part(save, "s10", mine)
    kept = save / "s10" / copies.PARTS / "node2"  # the master keeps the last node's part (the ring)
    kept.mkdir(parents=True)
    (kept / "mp_rank_00_model_states.pt").write_bytes(b"model")
    (kept / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"r1")
    stage = shrink.gather(str(save), "s10", ["node1", "node2"], ["node2"],
                          {"node1": held(["s10"], {"s10": ["node2"]})}, "node1")
    assert tree(Path(stage)) == {
        "mp_rank_00_model_states.pt": b"model", "zero_pp_rank_0_mp_rank_00_optim_states.pt": b"r0",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": b"r1", "COMPLETE": b"{}"}


def test_the_universal_checkpoint_replaces_the_tag_folder_on_a_survivor_and_newer_ones_go(tmp_path):
    master, survivor = tmp_path / "m", tmp_path / "s"
    converted = master / shrink.STAGE / "s10"
    converted.mkdir(parents=True)
    files = {"zero/h.0.weight/fp32.pt": b"w" * 100, "mp_rank_00_model_states.pt": b"model", "COMPLETE": b"{}",
             complete.UNIVERSAL: b'{"tag": "s10"}\n'}
    for name, data in files.items():
        (converted / name).parent.mkdir(parents=True, exist_ok=True)
        (converted / name).write_bytes(data)
    part(survivor, "s5", {"older.pt": b"kept"})
    part(survivor, "s10", {"zero_pp_rank_2_mp_rank_00_optim_states.pt": b"old part"})
    part(survivor, "s15", {"newer.pt": b"its lost node's part was never copied"})
    got, error = copies.relay([sys.executable, str(HELPER), "universal-send", str(master), "s10"],
                              [sys.executable, str(HELPER), "universal-receive", str(survivor), "s10"])
    assert error == "" and got == {"files": 4, "bytes": sum(map(len, files.values()))}
    assert tree(survivor / "s10") == files  # the old part replaced whole
    # s15, newer, lacks the lost node's part: gone, so that every loader takes s10; s5 stays
    assert complete.tags(str(survivor)) == ["s5", "s10"] and not (survivor / "s15").exists()
    assert [p.name for p in (survivor / shrink.STAGE).iterdir()] == []  # nothing left aside


def test_a_stream_without_the_universal_mark_is_refused_and_the_checkpoint_left_as_it_was(tmp_path):
    master, survivor = tmp_path / "m", tmp_path / "s"
    (master / shrink.STAGE / "s10").mkdir(parents=True)
    (master / shrink.STAGE / "s10" / "x.pt").write_bytes(b"x")
    part(survivor, "s10", {"own.pt": b"own"})
    got, error = copies.relay([sys.executable, str(HELPER), "universal-send", str(master), "s10"],
                              [sys.executable, str(HELPER), "universal-receive", str(survivor), "s10"])
    assert got is None and "the stream holds no universal checkpoint" in error
    assert tree(survivor / "s10") == {"own.pt": b"own"}


def test_the_survivors_command_leaves_the_lost_nodes_out_and_takes_their_world_sizes_config():
    cmd = ["/env/bin/deepspeed", "--hostfile", "/r/hostfile", "--include", "node1:0,1@node2:0,1@node3:0,1",
           "/h", "entry", "--module", "train.run", "--deepspeed_config", "/r/ds_config.json"]
    assert shrink.without(cmd, ["node2"])[4] == "node1:0,1@node3:0,1"
    cpu = ["/env/bin/deepspeed", "--hostfile", "/r/hostfile", "/h", "entry"]
    assert shrink.without(cpu, ["node2", "node3"]) == ["/env/bin/deepspeed", "--exclude", "node2@node3",
                                                         "--hostfile", "/r/hostfile", "/h", "entry"]


def test_the_launchs_command_for_fewer_nodes_or_all_of_them_again(tmp_path):
    run = RunDir(tmp_path)
    (tmp_path / RunDir.SHRINK).write_text(json.dumps({
        "min_nodes": 1, "nodes": HOSTS, "slots": dict.fromkeys(HOSTS, 2),
        "worlds": {"2": {"config": "ds_config.world2.json", "micro_batch": 4, "grad_accum": 3, "train_batch": 24},
                   "4": {"config": "ds_config.world4.json", "micro_batch": 3, "grad_accum": 2, "train_batch": 24},
                   "6": {"config": "ds_config.json", "micro_batch": 4, "grad_accum": 1, "train_batch": 24}}}))
    (tmp_path / RunDir.DS_ENV).write_text("DSC_NODE_NCCL_SOCKET_IFNAME=eth0/ens5/eth1\n")
    cmd = ["/env/bin/deepspeed", "--master_port", "29500", "--hostfile", f"{tmp_path}/hostfile", "/h", "entry",
           "--deepspeed_config", f"{tmp_path}/ds_config.json", "--resume"]
    env = {"DS_ENV_FILE": f"{tmp_path}/.deepspeed_env"}
    got, batch = shrink.command_for(run, cmd, ["node1", "node3"], env)
    assert got == ["/env/bin/deepspeed", "--exclude", "node2", "--master_port", "29500", "--hostfile",
                   f"{tmp_path}/hostfile", "/h", "entry", "--deepspeed_config", f"{tmp_path}/ds_config.world4.json",
                   "--resume"]
    assert batch["world"] == 4 and batch["micro_batch"] == 3
    assert env["DS_ENV_FILE"] == str(run / RunDir.SHRUNK_ENV)
    assert (tmp_path / RunDir.SHRUNK_ENV).read_text() == "DSC_NODE_NCCL_SOCKET_IFNAME=eth0/eth1\n"
    assert shrink.command_for(run, cmd, HOSTS, env)[0] == cmd  # every node again: the launch's own
    with pytest.raises(shrink.Refused, match="^the plan holds no configuration for 2 ranks on node1, node4$"):
        shrink.command_for(run, cmd, ["node1", "node4"], env)  # a node the run was not launched on


def test_each_nodes_own_settings_are_taken_for_the_survivors_in_their_order():
    text = "PATH=/env/bin\nDSC_NODE_NCCL_SOCKET_IFNAME=eth0/ens5/eth1\nDSC_NODE_NCCL_IB_GID_INDEX=3//3\n"
    assert shrink.node_env(text, HOSTS, ["node1", "node3"]) == (
        "PATH=/env/bin\nDSC_NODE_NCCL_SOCKET_IFNAME=eth0/eth1\nDSC_NODE_NCCL_IB_GID_INDEX=3/3\n")


def test_a_continuation_is_said_with_who_was_lost_the_checkpoint_and_the_batch():
    record = {"lost": ["node3"], "nodes": ["node1", "node2"], "of": 3, "at_step": 142, "checkpoint": "step140",
              "world": 2, "train_batch": 24, "micro_batch": 4, "grad_accum": 3, "why": ""}
    assert records.continued(record) == ("continued on 2 of 3 nodes after node3 was lost at step 142, from checkpoint "
                                   "step140; global batch 24 as micro-batch 4 x 3 accumulation x 2 ranks")
    record.update(checkpoint=None, why="global batch 36, not 32: 32 samples do not split evenly over 3 ranks")
    assert records.continued(record).endswith("from the start (no checkpoint saved); global batch 24 as micro-batch 4 x 3 "
                                        "accumulation x 2 ranks (global batch 36, not 32: 32 samples do not split "
                                        "evenly over 3 ranks)")


def test_status_follow_and_runs_say_the_run_went_on_on_fewer_nodes(tmp_path):
    from plugins.filter import cluster as filters  # noqa: PLC0415 - the control node's filters, for this test alone
    record = {"lost": ["node2"], "nodes": ["node1"], "of": 2, "at_step": 23, "checkpoint": "step20", "world": 1,
              "train_batch": 4, "micro_batch": 2, "grad_accum": 2, "why": ""}
    run = tmp_path / "r1"
    run.mkdir()
    for name, text in {RunDir.RUN_ID: "r1\n", RunDir.LOG: "x", RunDir.SHRINKS: json.dumps(record) + "\n"}.items():
        (run / name).write_text(text)
    st = records.status(run, "r1")
    assert [s["said"] for s in st["shrinks"]] == [
        "continued on 1 of 2 nodes after node2 was lost at step 23, from checkpoint step20; global batch 4 as "
        "micro-batch 2 x 2 accumulation x 1 ranks"]
    row = records.runs_table(tmp_path)[0]
    assert filters.runs_table([row])[1].split(" | ")[2] == "lost on 1 of 2 nodes"  # no supervisor here: lost
    back = dict(record, lost=[], back=["node2"], nodes=["node1", "node2"], at_step=None, world=2, grad_accum=1)
    assert records.continued(back) == ("continued on 2 of 2 nodes with node2 taken in again, from checkpoint step20; "
                                       "global batch 4 as micro-batch 2 x 1 accumulation x 2 ranks")


def test_a_resume_on_the_nodes_the_run_last_went_on_with_takes_their_command(tmp_path):
    from dscnode import supervisor  # noqa: PLC0415 - its start alone, here
    run = RunDir(tmp_path)
    (tmp_path / RunDir.SHRINK).write_text(json.dumps({
        "min_nodes": 1, "nodes": ["node1", "node2"], "slots": {"node1": 1, "node2": 1},
        "worlds": {"1": {"config": "ds_config.world1.json"}, "2": {"config": "ds_config.json"}}}))
    (tmp_path / RunDir.DS_ENV).write_text("PATH=/env/bin\n")
    cmd = ["/env/bin/deepspeed", "--hostfile", "h", "/h", "entry", "--deepspeed_config", f"{tmp_path}/ds_config.json"]
    env = {}
    assert supervisor.start_on(run, "r-fewer", cmd, ["node1", "node2"], env) == cmd and env == {}  # as launched
    (tmp_path / RunDir.SHRINKS).write_text(json.dumps({"lost": ["node2"], "nodes": ["node1"], "of": 2}) + "\n")
    assert supervisor.start_on(run, "r-fewer", cmd, ["node1"], env) == [
        "/env/bin/deepspeed", "--exclude", "node2", "--hostfile", "h", "/h", "entry", "--deepspeed_config",
        f"{tmp_path}/ds_config.world1.json"]


def test_a_regroup_recorded_on_a_worker_tells_it_as_a_later_master_where_the_run_last_ran(tmp_path):
    """The master's supervisor sends its shrinks.jsonl line to the other nodes it goes on with
    (write-shrink, through pdsh): a resume after that master is lost reads there which nodes the
    run ran on last, not the launch's. A line that is not a regroup's record is not kept."""
    run = RunDir(tmp_path)
    assert shrink.ran_on(run, HOSTS) == HOSTS
    record = {"lost": ["node2"], "back": [], "nodes": ["node1", "node3"], "of": 3, "checkpoint": "s10"}
    written = subprocess.run([sys.executable, str(HELPER), "write-shrink", str(tmp_path), json.dumps(record)],
                             capture_output=True, text=True)
    assert written.returncode == 0, written.stderr
    assert shrink.ran_on(run, HOSTS) == ["node1", "node3"]
    for bad in ('["node1"]', '{"nodes": "node1"}'):
        subprocess.run([sys.executable, str(HELPER), "write-shrink", str(tmp_path), bad], capture_output=True)
    assert (tmp_path / RunDir.SHRINKS).read_text().splitlines() == [json.dumps(record)]
