"""dsc_min_nodes as the plan decides it at launch (dscplan.shrink): each world size the run may go on
at, its batch (the same global batch where it can be) and ds_config, and the refusals, each naming
the variable and the fix. The supervisor's side is tests/unit/test_node_shrink.py.

    .venv/bin/pytest tests/unit/test_plan_shrink.py -q
"""
import json

import pytest

import dscplan
from dscplan.shrink import resume_without, shrunk_batch, smaller_worlds
from tests.unit.plan_helpers import DEFAULTS, PATHS, cluster, plan

GO_ON = {"preset": "zero2", "dsc_micro_batch": 4, "dsc_grad_accum": 2, "max_restarts": 2}


@pytest.mark.parametrize("total, micro, world, expected", [
    (24, 4, 2, (4, 3, 24, True)),    # 3 nodes x 1 rank at accumulation 2 -> 2 ranks: accumulation 3
    (24, 4, 3, (4, 2, 24, True)),
    (48, 4, 4, (4, 3, 48, True)),    # 6 ranks -> 4
    (24, 8, 2, (6, 2, 24, True)),    # 8 does not divide the 12 each rank takes: the largest below that does
    (32, 4, 3, (4, 3, 36, False)),   # 32 does not split over 3 ranks: the nearest, said
    (16, 4, 1, (4, 4, 16, True)),
])
def test_the_global_batch_stays_through_more_accumulation_and_never_a_larger_micro_batch(total, micro, world, expected):
    got = shrunk_batch(total, micro, world)
    assert (got["micro_batch"], got["grad_accum"], got["train_batch"], got["exact"]) == expected
    assert got["micro_batch"] <= micro
    assert got["micro_batch"] * got["grad_accum"] * world == got["train_batch"]
    assert bool(got["why"]) == (not got["exact"] or got["micro_batch"] != micro)
    if not got["exact"]:
        assert got["why"] == f"global batch {got['train_batch']}, not {total}: {total} samples do not split evenly over {world} ranks"


def test_each_world_size_of_the_master_and_enough_nodes_gets_its_config_and_the_batch_kept():
    p, errors = plan(3, options=dict(GO_ON, dsc_min_nodes=1), full_run=True)  # 2 ranks a node
    assert errors == []
    files = p["run"]["files"]
    shrink = json.loads(files["shrink.json"])
    assert shrink["min_nodes"] == 1 and shrink["slots"] == {"node1": 2, "node2": 2, "node3": 2}
    assert shrink["nodes"] == ["node1", "node2", "node3"]
    # the master alone, or with one other; 6 is the launch's own (every node back), its own file
    assert sorted(shrink["worlds"]) == ["2", "4", "6"] and shrink["worlds"]["6"]["config"] == "ds_config.json"
    assert sorted(f for f in files if f.startswith("ds_config")) == [
        "ds_config.json", "ds_config.world2.json", "ds_config.world4.json"]
    full = json.loads(files["ds_config.json"])
    assert full["train_batch_size"] == 4 * 2 * 6
    for world, sizes in shrink["worlds"].items():
        cfg = json.loads(files[sizes["config"]])
        assert sizes["config"] == (f"ds_config.world{world}.json" if world != "6" else "ds_config.json")
        assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (
            48, 4, 48 // (4 * int(world)))
        assert {k: v for k, v in cfg.items() if k not in (
            "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")} == {
            k: v for k, v in full.items() if k not in (
                "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}
    p, errors = plan(3, options=dict(GO_ON, dsc_min_nodes=2), full_run=True)
    assert sorted(json.loads(p["run"]["files"]["shrink.json"])["worlds"]) == ["4", "6"]


def test_the_world_sizes_are_those_of_any_nodes_left_the_master_among_the_lost_too():
    assert smaller_worlds([4, 2, 1], 1) == [1, 2, 3, 4, 5, 6]  # 7, every node, is the launch's own
    assert smaller_worlds([4, 2, 1], 2) == [3, 5, 6]
    assert smaller_worlds([8] * 64, 63) == [504]  # 64 nodes: no combinations counted


@pytest.mark.parametrize("value", [0, 3])
def test_zero_or_every_node_writes_nothing(value):
    p, errors = plan(3, options=dict(GO_ON, dsc_min_nodes=value), full_run=True)
    assert errors == [] and not [f for f in p["run"]["files"] if f.startswith(("shrink", "ds_config.world"))]


@pytest.mark.parametrize("value", [-1, 4, "two", 1.5])
def test_a_count_outside_the_cluster_is_refused(value):
    p, errors = plan(3, options=dict(GO_ON, dsc_min_nodes=value), full_run=True)
    assert p is None and errors == [
        f"dsc_min_nodes is {value!r}. Fix: the fewest nodes the run may go on with, 1 to 3 (the inventory's "
        f"nodes), or 0 to fail the run as before."]


@pytest.mark.parametrize("options, settings, needle", [
    ({"max_restarts": 0}, {}, "max_restarts is 0: a run goes on on fewer nodes at a restart. Fix: -e max_restarts=2"),
    ({"dsc_checkpoint_copies": False}, {}, "dsc_checkpoint_copies is false: a lost node's part of each checkpoint would go with it"),
    ({"max_restarts": 0}, {"dsc_launch_mode": "no_ssh"}, "dsc_launch_mode no_ssh starts no supervisor that reaches every node"),
    ({"dsc_ds_config_mode": "none"}, {}, "the run's DeepSpeed config sets no whole train_batch_size"),
])
def test_a_run_that_could_not_go_on_is_refused_at_launch_naming_why_and_the_fix(options, settings, needle):
    p, errors = plan(3, options=dict(GO_ON, dsc_min_nodes=2, **options), full_run=True, **settings)
    assert p is None and any(e.startswith("dsc_min_nodes=2: ") and needle in e for e in errors), errors


def test_a_shared_checkpoint_directory_takes_the_place_of_copies_and_train_run_saves_there():
    """dsc_checkpoint_shared_dir: DeepSpeed saves each checkpoint once (not node-local), train.run's
    checkpoint_dir is <dir>/<run id> (launch.json keeps it for resume), the roles check the
    directory on every node, and a run may go on on fewer nodes without copies."""
    options = dict(GO_ON, dsc_min_nodes=2, dsc_checkpoint_copies=False, dsc_checkpoint_shared_dir="/shared/ckpt",
                   run_id="r1", dsc_train_config={"steps": 10})
    p, errors = plan(3, options=options, full_run=True)
    assert errors == []
    files = p["run"]["files"]
    for name in ("ds_config.json", "ds_config.world4.json"):
        assert json.loads(files[name])["checkpoint"] == {"use_node_local_storage": False}
    assert json.loads(files["train.json"]) == {"steps": 10, "checkpoint_dir": "/shared/ckpt/r1"}
    assert json.loads(files["launch.json"])["dsc_train_config"]["checkpoint_dir"] == "/shared/ckpt/r1"
    assert p["run"]["checkpoint_shared_dir"] == "/shared/ckpt"
    own = dict(options, dsc_train_config={"steps": 10, "checkpoint_dir": "/shared/mine"})
    assert json.loads(plan(3, options=own, full_run=True)[0]["run"]["files"]["train.json"])["checkpoint_dir"] == "/shared/mine"
    p, errors = plan(3, options=dict(GO_ON, run_id="r1"), full_run=True)
    assert p["run"]["checkpoint_shared_dir"] == "" and "checkpoint_dir" not in json.loads(p["run"]["files"]["train.json"])
    assert json.loads(p["run"]["files"]["ds_config.json"])["checkpoint"] == {"use_node_local_storage": True}


@pytest.mark.parametrize("value, needle", [
    ("shared/ckpt", "is 'shared/ckpt', not an absolute path"),
    ("/shared/../etc/ckpt", "Fix: an absolute path of letters, digits"),
    ("/shared/ck pt;rm", "Fix: an absolute path of letters, digits"),
    ("/etc", "in the system tree /etc"),
    ("/shared/$(id)", "Fix: an absolute path of letters, digits"),
    ("/shared/ckpt\n", "Fix: an absolute path of letters, digits"),
    ("/shared/ckpt;reboot", "Fix: an absolute path of letters, digits"),
    ("#jinja2:variable_start_string:'[%'\n/shared/[% 7*7 %]", "not an absolute path"),
])
def test_a_shared_checkpoint_directory_that_is_no_safe_absolute_path_is_refused(value, needle):
    p, errors = plan(3, options=dict(GO_ON, dsc_checkpoint_shared_dir=value), full_run=True)
    assert p is None and any(e.startswith("dsc_checkpoint_shared_dir (where every node saves its checkpoints) is ")
                             and needle in e for e in errors), errors


def test_a_shared_checkpoint_directory_with_a_config_that_saves_node_local_is_refused():
    overrides = {"checkpoint": {"use_node_local_storage": True}}
    p, errors = plan(3, options=dict(GO_ON, dsc_checkpoint_shared_dir="/shared/ckpt", dsc_ds_config_overrides=overrides),
                     full_run=True)
    assert p is None and any("sets checkpoint.use_node_local_storage true" in e and
                             "Fix: drop that key, or dsc_checkpoint_shared_dir." in e for e in errors), errors


def test_a_resume_with_a_node_that_does_not_answer_goes_on_on_the_others_as_dsc_min_nodes_allows():
    """resume.yml with node1, the master, not answering (its probe gave no report): the run's
    launch spec, read on node2, says dsc_min_nodes 1, so the plan is made for node2 and node3
    (node2 the master) and says so; at dsc_min_nodes 3, or for a run launched without it, or a
    launch, the unreachable node stays refused as before."""
    hostvars, groups, probes = cluster(3)
    stopped = {"id": "r1", "mtime": 1, "started": True, "active": False,
               "launch": dict(GO_ON, dsc_min_nodes=1)}
    for node in ("node2", "node3"):
        probes[node]["runs"] = [stopped]
    del probes["node1"]
    names = groups["cluster"]
    left, note = resume_without(names, ["node1"], probes, {"resume": True})
    assert left == ["node2", "node3"] and note == (
        "node1 does not answer: run r1 resumes on node2, node3, node2 its master (its dsc_min_nodes is 1), "
        "from its newest checkpoint converted for them.")
    p, errors = dscplan.make_plan(hostvars, {"cluster": left}, probes, DEFAULTS, PATHS, {"resume": True},
                                  full_run=True)
    assert errors == [] and p["master"] == "node2" and p["run"]["id"] == "r1"
    assert [n["name"] for n in p["nodes"]] == ["node2", "node3"] and p["world_size"] == 4

    assert resume_without(names, ["node1"], probes, {}) == (None, "")  # a launch
    for node in ("node2", "node3"):
        probes[node]["runs"] = [dict(stopped, launch=dict(GO_ON, dsc_min_nodes=3))]
    assert resume_without(names, ["node1"], probes, {"resume": True, "run_id": "r1"}) == (
        None, "run r1 goes on with at least 3 node(s) (its dsc_min_nodes), and 2 answer: node2, node3. "
              "Fix: bring a node back first.")
    for node in ("node2", "node3"):
        probes[node]["runs"] = [dict(stopped, launch=dict(GO_ON))]
    assert resume_without(names, ["node1"], probes, {"resume": True}) == (None, "")


@pytest.mark.parametrize("recorded", ["2\n", "$(id)", "1;reboot", "../1", "#jinja2: x\n2", "{{ 2 }}", True, 2.5, -1, "0"])
def test_a_resume_without_a_node_takes_only_a_whole_dsc_min_nodes_from_the_runs_record(recorded):
    """launch.json is the training user's: a dsc_min_nodes there that is not a whole number of
    nodes leaves the node that does not answer refused, as for a run launched without it."""
    _, groups, probes = cluster(3)
    for node in ("node2", "node3"):
        probes[node]["runs"] = [{"id": "r1", "mtime": 1, "started": True, "active": False,
                                 "launch": dict(GO_ON, dsc_min_nodes=recorded)}]
    assert resume_without(groups["cluster"], ["node1"], probes, {"resume": True}) == (None, "")
