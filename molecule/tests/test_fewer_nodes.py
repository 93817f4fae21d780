"""dsc_min_nodes on three more nodes of the test network, started from the provisioned image (the
main cluster's network, control key and image) and made one cluster by `provision.yml --tags
network`: a ZeRO-2 run goes on on two nodes when one is stopped with podman stop and takes it in
again at a resume; a ZeRO-2 run saving to a directory the three share (a podman volume,
dsc_checkpoint_shared_dir) goes on on two from its one copy; a ZeRO-3 run goes on on the other
two at resume.yml when the master is stopped. The ZeRO-2 run goes on from a checkpoint older than its last step: the steps it trains
again on two nodes, at the same global batch, give the losses the three nodes gave them. A file of its
own: its nodes beside the cluster's, on whichever worker is free. (Without dsc_min_nodes a lost
node fails the run: test_faults.py's dead worker.)"""
import json
import subprocess
import time

import pytest

import cluster as tc
from dscnode import complete, records
from cluster import TINY, UNTIL_STOPPED, wait

NODES = [{"name": f"few{i}", "ip": tc.addr(60 + i), "ip6": tc.addr6(60 + i), "port": 22} for i in (1, 2, 3)]
RUNS = tc.RUNS
# The steps trained again after a regroup give the three nodes' losses within this (relative):
# the same data and global batch, summed over 2 ranks instead of 3 (tests/local/test_train.py
# holds a conversion to 1e-4 on one machine).
LOSS_TOLERANCE = 1e-3


# A podman volume every node mounts at /shared: the shared filesystem of dsc_checkpoint_shared_dir.
VOLUME, SHARED = "dsc-few-shared", "/shared/ckpt"


@pytest.fixture(scope="module")
def three(cluster, node_image, tmp_path_factory):
    """The three nodes as a cluster of their own: their names, SSH trust and firewall, and a
    folder they share (SHARED, the training user's)."""
    where = tmp_path_factory.mktemp("fewer")
    subprocess.run(["podman", "volume", "rm", "-f", VOLUME], check=False, capture_output=True)
    try:
        with tc.extra_nodes(NODES, where, lambda c, h: tc.start(c, h["name"], h["ip"], h["ip6"], 22, node_image[0],
                                                                volumes=[f"{VOLUME}:/shared"])) as inventory:
            nodes = tc.Cluster({"hosts": NODES}, inventory=inventory, known_hosts=where / "known_hosts")
            r = nodes.playbook("provision.yml", "--tags", "network")
            assert r.returncode == 0, r.output[-5000:]
            nodes.exec(nodes.names[0], f"install -d -o dstrain -g dstrain -m 0750 {SHARED}")
            yield nodes
    finally:
        subprocess.run(["podman", "volume", "rm", "-f", VOLUME], check=False, capture_output=True)


def last(nodes, node, name, run):
    """The last line of a file of the run on `node`, parsed ({} while there is none)."""
    return json.loads(nodes.exec(node, f"tail -1 {RUNS}/{run}/{name} 2>/dev/null || true").stdout or "{}")


def metrics(nodes, node, run):
    """The run's metrics.jsonl lines on `node` (train.run's, global rank 0's node)."""
    return [json.loads(x) for x in nodes.exec(node, f"cat {RUNS}/{run}/metrics.jsonl 2>/dev/null || true").stdout.splitlines()]


def regrouped(nodes, node, since, run):
    """The run's regroup recorded on `node` after the time `since`, once there is one (else the
    end of that node's launcher log, which says why not)."""
    try:
        return wait(lambda: (r := last(nodes, node, "shrinks.jsonl", run)).get("time", 0) > since and r, 300,
                    f"the run to regroup (on {node})")
    except AssertionError as e:
        log = nodes.exec(node, f"tail -c 4000 {RUNS}/{run}/launcher.log", check=False).stdout
        raise AssertionError(f"{e}; {node}'s launcher log ends:\n{log}") from None


def step_after(nodes, node, since, run):
    """The run's first step logged on `node` after the time `since`, once there is one."""
    return wait(lambda: next((m for m in metrics(nodes, node, run) if m["time"] > since), None), 300,
                f"a step on {node}")


def same_losses_again(nodes, node, record, run):
    """The steps the run trained again after the regroup `record` (those after its checkpoint, up
    to where the lost node stopped it) against the same steps before: {step: (before, after)},
    each within LOSS_TOLERANCE, once the run is past them."""
    again = range(record["from_step"] + 1, record["at_step"] + 1)
    assert len(again) >= 1, record
    wait(lambda: any(m["time"] > record["time"] and m["step"] >= again[-1] for m in metrics(nodes, node, run)),
         300, f"step {again[-1]} again on {node}")
    lines = metrics(nodes, node, run)
    before = {m["step"]: m["loss"] for m in lines if m["time"] < record["time"] and m["step"] in again}
    after = {m["step"]: m["loss"] for m in lines if m["time"] > record["time"] and m["step"] in again}
    pairs = {step: (before[step], after[step]) for step in again if step in before and step in after}
    assert pairs, (record, before, after)
    for step, (a, b) in pairs.items():
        assert abs(a - b) <= LOSS_TOLERANCE * max(1.0, abs(a)), (step, a, b, record)
    return pairs


def kept_on_all(nodes, master, count, run, since=0.0):
    """The newest checkpoint, saved after `since`, whose parts `master`'s supervisor kept on the
    next node each (`count` of them), once there is one."""
    def found():
        lines = nodes.exec(master, f"cat {RUNS}/{run}/copies.jsonl 2>/dev/null || true").stdout.splitlines()
        kept = [c for c in map(json.loads, lines) if len(c["kept"]) == count and not c["failed"] and c["time"] > since]
        return kept[-1] if kept else None
    return wait(found, 240, f"a checkpoint's parts kept on all {count} nodes")


def stop(node):
    subprocess.run(["podman", "stop", "-t", "0", tc.PREFIX + node], check=True, capture_output=True)


def launched(nodes, run, preset, *args):
    """A run on the three nodes with dsc_min_nodes=2, one rank each, micro-batch 2 x accumulation
    2 (global batch 12), once a checkpoint's parts are kept on every node (or, `args` naming
    dsc_checkpoint_shared_dir, once one is marked complete there). A save every 2 s or so; a copy
    takes about 1 s, so about every 5th is copied (the copier's pace: a tenth of the time), and
    retention keeps the last 20: a copied one stays."""
    r = nodes.playbook(
        "launch.yml", "-e", f"preset={preset}", "-e", f"run_id={run}", "-e", "preflight=false",
        "-e", "dsc_micro_batch=2", "-e", "dsc_grad_accum=2", "-e", "max_restarts=1", "-e", "restart_backoff_s=1",
        "-e", "dsc_min_nodes=2", *args,
        "-e", json.dumps({"dsc_train_config": dict(TINY, **UNTIL_STOPPED, save_every=20, keep_checkpoints=20)}))
    assert r.returncode == 0, r.output[-5000:]
    config = json.loads(nodes.exec(nodes.names[0], f"cat {RUNS}/{run}/ds_config.json").stdout)
    assert (config["train_batch_size"], config["gradient_accumulation_steps"]) == (12, 2), config
    if any(a.startswith("dsc_checkpoint_shared_dir=") for a in args):
        wait(lambda: nodes.exec(nodes.names[1], f"cat {SHARED}/{run}/{complete.MARKS} 2>/dev/null || true").stdout.strip(),
             240, "a checkpoint marked complete in the shared directory")
    else:
        kept_on_all(nodes, nodes.names[0], 3, run)


def stopped_everywhere(nodes, run, down, tmp_path):
    """stop.yml on the nodes that answer (it needs every node of its inventory to), then `down` started again."""
    survivors = tmp_path / "survivors"
    tc.write_inventory([h for h in NODES if h["name"] != down], inv=survivors, known_hosts=nodes.known_hosts)
    nodes.playbook("stop.yml", "-e", f"run_id={run}", inventory=survivors)
    if down:
        nodes.start_again(down)


def test_a_zero2_run_goes_on_on_two_of_three_nodes_and_takes_the_third_back(three, figures, tmp_path):
    """few3 stopped once a checkpoint's parts are kept on every node: at the restart the master's
    supervisor drops it, converts that checkpoint (few3's part from its copy on few1) with
    ds_to_universal, and the run goes on on few1 and few2 from it at global batch 12 (accumulation
    3), its next step the checkpoint's + 1, the steps it trains again with the three nodes' losses;
    status.yml says so. few3 back, a resume takes it in again (the newest checkpoint converted for
    three ranks)."""
    run = "few-2"
    first, second, third = (h["name"] for h in NODES)
    down = None
    try:
        launched(three, run, "zero2")
        lost_at, down = time.time(), third
        stop(third)
        record = regrouped(three, first, lost_at, run)
        assert (record["lost"], record["nodes"], record["world"], record["train_batch"], record["grad_accum"],
                record["micro_batch"], record["exact"]) == ([third], [first, second], 2, 12, 3, 2, True), record
        wait(lambda: last(three, second, "shrinks.jsonl", run) == record, 30, "the regroup recorded on the other survivor")
        went_on = step_after(three, first, record["time"], run)
        assert went_on["step"] == record["from_step"] + 1, (went_on, record)
        tag = record["checkpoint"]
        log = three.exec(first, f"cat {RUNS}/{run}/launcher.log").stdout
        assert f"resume: loaded {RUNS}/{run}/checkpoints/{tag} (step {record['from_step']})" in log, log[-3000:]
        mark = json.loads(three.exec(second, f"cat {RUNS}/{run}/checkpoints/{tag}/dsc_universal").stdout)
        assert (mark["lost"], mark["from"], mark["to"]) == ([third], three.names, [first, second]), mark
        converted = [x for x in log.splitlines() if f"checkpoint {tag} converted for 2 ranks" in x]
        losses = same_losses_again(three, first, record, run)
        figures("node lost, went on", seconds_to_next_step=round(went_on["time"] - lost_at, 1), checkpoint=tag,
                lost_at_step=record["at_step"], converted=converted[-1][len("[dsc_node] "):],
                losses_before_and_after=losses)
        shown = three.playbook("status.yml", "-e", f"run_id={run}")
        assert (f"continued on 2 of 3 nodes after {third} was lost at step {record['at_step']}, from "
                f"checkpoint {tag}") in shown.output, shown.output[-3000:]
        assert f"run {run}: running" in shown.output and f"{third}: unreachable" in shown.output

        three.start_again(third)
        down = None
        assert three.playbook("stop.yml", "-e", f"run_id={run}").returncode == 0
        stopped = time.time()
        again = three.playbook("resume.yml", "-e", f"run_id={run}", "-e", "preflight=false")
        assert again.returncode == 0, again.output[-4000:]
        back = regrouped(three, first, stopped, run)
        assert (back["lost"], back["back"], back["nodes"], back["world"], back["grad_accum"]) == (
            [], [third], three.names, 3, 2), back
        assert wait(lambda: three.rank_pids(third, run), 120, f"a rank on {third} again")
        assert step_after(three, first, back["time"], run)["step"] == back["from_step"] + 1
        log = three.exec(first, f"cat {RUNS}/{run}/launcher.log").stdout
        assert f"continued on 3 of 3 nodes with {third} taken in again, from checkpoint {back['checkpoint']}" in log
        figures("node lost, taken back", said=[records.continued(r) for r in (record, back)])
    finally:
        stopped_everywhere(three, run, down, tmp_path)


def test_a_run_saving_to_a_shared_directory_goes_on_on_two_nodes_from_its_one_copy(three, figures, tmp_path):
    """dsc_checkpoint_shared_dir: a folder each node has of its own is refused before anything
    starts, naming the nodes that do not see the master's mark. On the volume the three share,
    DeepSpeed saves each checkpoint once (no copies kept); few3 stopped, the master's supervisor
    converts the newest checkpoint marked there in place, and the run goes on on few1 and few2
    from it at global batch 12."""
    run = "few-s"
    first, second, third = (h["name"] for h in NODES)
    own = "/tmp/not-shared"
    refused = three.playbook("launch.yml", "-e", "preset=zero2", "-e", f"run_id={run}", "-e", "preflight=false",
                             "-e", f"dsc_checkpoint_shared_dir={own}", "-e", json.dumps({"dsc_train_config": TINY}))
    assert refused.returncode != 0
    for node in (second, third):
        assert (f"dsc_checkpoint_shared_dir {own} on {node} is not the directory {first} has there"
                in refused.output), refused.output[-3000:]
    assert f"on {first} is not the directory" not in refused.output
    for node in three.names:
        assert three.exec(node, f"test ! -e {RUNS}/{run} && ls -A {own} 2>/dev/null | wc -l").stdout.strip() == "0"
    down = None
    try:
        launched(three, run, "zero2", "-e", f"dsc_checkpoint_shared_dir={SHARED}")
        config = json.loads(three.exec(first, f"cat {RUNS}/{run}/ds_config.json").stdout)
        assert config["checkpoint"] == {"use_node_local_storage": False}
        lost_at, down = time.time(), third
        stop(third)
        record = regrouped(three, first, lost_at, run)
        assert (record["lost"], record["nodes"], record["world"], record["train_batch"], record["grad_accum"]) == (
            [third], [first, second], 2, 12, 3), record
        went_on = step_after(three, first, record["time"], run)
        assert went_on["step"] == record["from_step"] + 1, (went_on, record)
        tag = record["checkpoint"]
        log = three.exec(first, f"cat {RUNS}/{run}/launcher.log").stdout
        assert f"resume: loaded {SHARED}/{run}/{tag} (step {record['from_step']})" in log, log[-3000:]
        mark = json.loads(three.exec(second, f"cat {SHARED}/{run}/{tag}/{complete.UNIVERSAL}").stdout)
        assert (mark["lost"], mark["to"]) == ([third], [first, second]), mark
        assert "kept on the next node" not in log and not three.exec(
            first, f"find {SHARED}/{run} -name .dsc_parts").stdout.strip()
        converted = [x for x in log.splitlines() if f"checkpoint {tag} converted for 2 ranks" in x]
        figures("shared directory, node lost", seconds_to_next_step=round(went_on["time"] - lost_at, 1),
                converted=converted[-1][len("[dsc_node] "):])
    finally:
        stopped_everywhere(three, run, down, tmp_path)


def test_a_zero3_run_outlives_its_master(three, figures, tmp_path):
    """few1, the master, stopped once a checkpoint's parts are kept on every node: resume.yml with
    the inventory unchanged says few1 does not answer and goes on on few2 and few3, few2 the
    master, from the newest checkpoint with few1's part from its copy on few2 (the lost master took
    the run's metrics with it: the losses are compared in the ZeRO-2 run above). Each regroup is
    recorded on every node it went on with, so a later master knows where the run last ran."""
    run = "few-3"
    first, second, third = (h["name"] for h in NODES)
    down = None
    try:
        launched(three, run, "zero3")
        down, lost_at = first, time.time()
        stop(first)
        # resume.yml with the same inventory: the master does not answer, and the run goes on on
        # the other two (their ranks, still waiting in a collective for the master's, stopped first)
        moved = three.playbook("resume.yml", "-e", f"run_id={run}", "-e", "preflight=false")
        assert moved.returncode == 0, moved.output[-4000:]
        said = (f"{first} does not answer: run {run} resumes on {second}, {third}, {second} its master (its "
                f"dsc_min_nodes is 2), from its newest checkpoint converted for them.")
        assert said in moved.output, moved.output[-4000:]
        taken = regrouped(three, second, lost_at, run)
        assert (taken["lost"], taken["nodes"], taken["world"], taken["grad_accum"]) == (
            [first], [second, third], 2, 3), taken
        assert step_after(three, second, taken["time"], run)["step"] == taken["from_step"] + 1
        log = three.exec(second, f"cat {RUNS}/{run}/launcher.log").stdout
        assert (f"continued on 2 of 3 nodes after {first} was lost, from checkpoint {taken['checkpoint']}; global "
                f"batch 12 as micro-batch 2 x 3 accumulation x 2 ranks") in log, log[-3000:]
        assert f"resume: loaded {RUNS}/{run}/checkpoints/{taken['checkpoint']} (step {taken['from_step']})" in log
        figures("master lost", said=[said, records.continued(taken)])
    finally:
        stopped_everywhere(three, run, down, tmp_path)
