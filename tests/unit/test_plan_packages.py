"""What the plan has the nodes install (dscplan.packages): requirements split from the torch family
and checked against a wheelhouse, the wheelhouse's lock and a node lock (wheels and source
archives), and the pip sources (a plain-HTTP index only with a lock).

    .venv/bin/pytest tests/unit/test_plan_packages.py -q
"""
import hashlib
import json
import os

import pytest

import dscplan
from dscnode.probe import installed, recorded_ops
from tests.unit.plan_helpers import DEFAULTS, PATHS, cluster, plan


def wheelhouse(tmp_path, *files):
    d = tmp_path / "wheels"
    d.mkdir()
    for f in files:
        (d / f).write_text("")
    return str(d)


def test_requirements_split_torch_family_and_are_checked_against_the_wheelhouse(tmp_path):
    wh = wheelhouse(tmp_path, "transformers-4.57.6-py3-none-any.whl", "torchvision-0.28.0-cp311-cp311-linux_x86_64.whl",
                    "Datasets-5.0.1-py3-none-any.whl", "py_spy-0.4.2-py2.py3-none-manylinux_2_5_x86_64.manylinux1_x86_64.whl")
    req = tmp_path / "requirements.txt"
    req.write_text("# the script's packages\ndatasets==5.0.1  # comment\n\n")
    p, errors = plan(dsc_requirements=["transformers==4.57.6", "torchvision==0.28.0"],
                     dsc_requirements_file=str(req), dsc_wheelhouse=wh)
    assert errors == []
    assert p["torch_requirements"] == ["torchvision==0.28.0"]
    # py-spy (dsc_py_spy_version, the stack reader) comes with every env; none when it is empty
    assert p["requirements"] == ["transformers==4.57.6", "datasets==5.0.1", "py-spy==0.4.2"]
    p, errors = plan(dsc_requirements=["transformers==4.57.6"], dsc_py_spy_version="", dsc_wheelhouse=wh)
    assert errors == [] and p["requirements"] == ["transformers==4.57.6"]
    p, errors = plan(dsc_requirements=["py-spy==0.4.1"])
    assert any("'py-spy==0.4.1'. Fix: drop it" in e and "dsc_py_spy_version" in e for e in errors), errors
    p, errors = plan(dsc_py_spy_version="latest")
    assert any("dsc_py_spy_version on host node1 is 'latest', not an exact version" in e for e in errors), errors
    p, errors = plan(dsc_requirements=["transformers==9.9", "accelerate"], dsc_wheelhouse=wh)
    assert any("'transformers==9.9' is not in dsc_wheelhouse" in e and "it has 4.57.6" in e
               and "scripts/wheelhouse.sh" in e for e in errors), errors
    assert any("'accelerate' is not in dsc_wheelhouse" in e and "none there" in e for e in errors), errors


def test_a_wheelhouse_lock_must_pin_the_plans_torch_deepspeed_and_requirements(tmp_path):
    wh = wheelhouse(tmp_path, "transformers-4.57.6-py3-none-any.whl", "py_spy-0.4.2-py2.py3-none-manylinux_2_5_x86_64.manylinux1_x86_64.whl")
    h = "0" * 64
    lock = tmp_path / "wheels" / "requirements.lock"
    lock.write_text(f"# written by scripts/wheelhouse.sh\ntorch==2.13.0+cpu --hash=sha256:{h}\n"
                    f"deepspeed==0.19.8 --hash=sha256:{h}\ntransformers==4.57.6 --hash=sha256:{h}\n"
                    f"py-spy==0.4.2 --hash=sha256:{h}\n")
    p, errors = plan(dsc_requirements=["transformers==4.57.6"], dsc_wheelhouse=wh,
                     dsc_torch_version="2.13.0", dsc_deepspeed_version="0.19.8")
    assert errors == [] and p["locked"] is True and p["lock"]["from"] == "wheelhouse"
    assert len(p["lock"]["wheels"]) == 4 and p["lock"]["sdists"] == []
    assert p["pip_lock_args"] == p["pip_source_args"] == "--no-index --find-links /opt/dscluster/wheelhouse"
    p, errors = plan(dsc_requirements=["transformers==4.57.6"], dsc_wheelhouse=wh,
                     dsc_torch_version="2.12.0", dsc_deepspeed_version="0.19.8")
    assert any("dsc_wheelhouse on host node1: its lock has torch 2.13.0+cpu, the plan wants torch==2.12.0"
               in e for e in errors), errors
    # a lock from before py-spy came with every env
    lock.write_text("\n".join(lock.read_text().splitlines()[:-1]) + "\n")
    assert any("its lock has py-spy not at all, the plan wants py-spy==0.4.2" in e
               for e in plan(dsc_wheelhouse=wh)[1])
    lock.write_text("torch==2.13.0\n")
    assert any("not a hashed pin" in e for e in plan(dsc_wheelhouse=wh)[1])
    lock.unlink()
    assert plan(dsc_wheelhouse=wh)[0]["locked"] is False


def test_a_node_lock_from_an_index_splits_wheels_from_source_packages(tmp_path):
    h = "0" * 64
    lock = tmp_path / "nodes.lock"
    lines = [f"torch==2.13.0+cpu --hash=sha256:{h}", f"setuptools==80.9.0 --hash=sha256:{h}",
             f"py-spy==0.4.2 --hash=sha256:{h}", f"deepspeed==0.19.8 --hash=sha256:{h}  # sdist"]
    lock.write_text("# written by scripts/nodelock.sh\n" + "\n".join(lines) + "\n")
    pins = dict(dsc_torch_version="2.13.0", dsc_deepspeed_version="0.19.8")
    p, errors = plan(dsc_node_lock=str(lock), dsc_pip_index_url="http://10.0.0.5:8080/simple", **pins)
    assert errors == [] and p["lock"] == {"from": "index", "wheels": lines[:3], "sdists": lines[3:]}
    index = "--index-url http://10.0.0.5:8080/simple --trusted-host 10.0.0.5:8080"
    assert p["pip_source_args"] == index
    assert p["pip_lock_args"] == f"{index} --extra-index-url https://download.pytorch.org/whl/cpu"
    # plain HTTP only when every file is checked against the lock
    assert any("plain HTTP, and no dsc_node_lock" in e for e in plan(dsc_pip_index_url="http://10.0.0.5/simple")[1])
    p, errors = plan(dsc_pip_index_url="https://mirror.example/simple")
    assert errors == [] and p["pip_source_args"] == "--index-url https://mirror.example/simple"
    assert p["pip_torch_args"] == "--index-url https://download.pytorch.org/whl/cpu"  # torch from its own
    # source packages need the lock's own setuptools (no isolated, unchecked build environment)
    lock.write_text("\n".join([lines[0], lines[2], lines[3]]) + "\n")
    assert any("dsc_node_lock on host node1" in e and "no setuptools" in e and "scripts/nodelock.sh" in e
               for e in plan(dsc_node_lock=str(lock), **pins)[1])
    lock.write_text("\n".join(lines[:3]) + "\n")
    assert any("dsc_node_lock on host node1: its lock has deepspeed not at all" in e
               for e in plan(dsc_node_lock=str(lock), **pins)[1])


@pytest.mark.parametrize("var, value, message", [
    ("dsc_node_lock", "/nonexistent/nodes.lock", "which is not a file on the control node"),
    ("dsc_pip_index_url", "ftp://mirror/simple", "Fix: an http(s) URL"),
    ("dsc_pip_index_url", "https://mirror/simple --trusted-host evil", "Fix: an http(s) URL"),
    ("dsc_pip_index_url", "https://mirror/simple;id", "Fix: an http(s) URL"),
    ("dsc_pip_index_url", "https://mirror/$(touch /tmp/pwned)", "Fix: an http(s) URL"),
    ("dsc_pip_index_url", "https://mirror/simple\n--trusted-host evil", "Fix: an http(s) URL"),
    ("dsc_node_lock", "/tmp/../nonexistent/nodes.lock", "which is not a file on the control node"),
])
def test_bad_node_lock_and_index_are_refused(var, value, message):
    errors = plan(**{var: value})[1]
    assert any(f"{var} on host node1" in e and message in e for e in errors), errors


def test_a_node_holding_the_lock_and_the_wheelhouse_is_sent_neither(tmp_path):
    """Provision sends the lock's files and the wheelhouse only where the probe found them other
    than it would put them (dscnode.probe.installed, on a real folder here, against the control
    node's wheelhouse): a provision that changes nothing sends nothing."""
    h = "0" * 64
    wh = wheelhouse(tmp_path, "transformers-4.57.6-py3-none-any.whl", "py_spy-0.4.2-py2.py3-none-manylinux_2_5_x86_64.manylinux1_x86_64.whl")
    (tmp_path / "wheels" / "requirements.lock").write_text(
        f"torch==2.13.0+cpu --hash=sha256:{h}\ndeepspeed==0.19.8 --hash=sha256:{h}\n"
        f"py-spy==0.4.2 --hash=sha256:{h}\n")
    node_root = tmp_path / "node"
    (node_root / "wheelhouse").mkdir(parents=True)
    for f in (tmp_path / "wheels").iterdir():  # as rsync -t leaves them: same size and time
        (node_root / "wheelhouse" / f.name).write_bytes(f.read_bytes())
        os.utime(node_root / "wheelhouse" / f.name, (f.stat().st_mtime, f.stat().st_mtime))
    p0, _ = plan(dsc_wheelhouse=wh, dsc_torch_version="2.13.0", dsc_deepspeed_version="0.19.8")
    (node_root / "lock-wheels.txt").write_text("\n".join(p0["lock"]["wheels"]) + "\n")
    (node_root / "lock-sdists.txt").write_text("\n")

    def node1(**settings):
        hostvars, groups, probes = cluster(dsc_wheelhouse=wh, dsc_torch_version="2.13.0",
                                           dsc_deepspeed_version="0.19.8", **settings)
        probes["node1"]["installed"] = installed(str(node_root))
        p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, now="20261130-000000")
        assert errors == []
        return {k: p["node"]["node1"][k] for k in ("lock_current", "wheelhouse_current")}, p["node"]["node2"]

    here, other = node1()
    assert here == {"lock_current": True, "wheelhouse_current": True}
    # node2's probe reported nothing installed: both are sent there
    assert (other["lock_current"], other["wheelhouse_current"]) == (False, False)
    # a wheel changed on the control node (size), one gone from the node, a lock line changed
    (tmp_path / "wheels" / "transformers-4.57.6-py3-none-any.whl").write_text("x")
    assert node1()[0] == {"lock_current": True, "wheelhouse_current": False}
    (node_root / "wheelhouse" / "transformers-4.57.6-py3-none-any.whl").write_text("x")
    os.utime(node_root / "wheelhouse" / "transformers-4.57.6-py3-none-any.whl",
             (os.stat(tmp_path / "wheels" / "transformers-4.57.6-py3-none-any.whl").st_mtime,) * 2)
    assert node1()[0]["wheelhouse_current"] is True
    (node_root / "lock-sdists.txt").write_text("setuptools==80.9.0\n")
    assert node1()[0] == {"lock_current": False, "wheelhouse_current": True}
    # a link where the lock file should be is never read through (the probe runs as root)
    (node_root / "lock-sdists.txt").unlink()
    (tmp_path / "elsewhere").write_text("\n")
    (node_root / "lock-sdists.txt").symlink_to(tmp_path / "elsewhere")
    assert installed(str(node_root))["lock"]["sdists"] is None and node1()[0]["lock_current"] is False


def test_each_kind_of_node_builds_its_ops_once_on_the_node_that_has_most_of_them(tmp_path):
    """The plan's node[].ops_kind and ops_source (roles/deepspeed ships the source's build to the
    others of its kind): the kind follows the CPU (the probe's digest of it) and the GPUs' compute
    capability; the master is its own kind's source, whatever the others hold; another kind's is
    its node with the most ops the toolkit's warm-up built (the probe's `installed.ops`, read from
    real folders and a record here), the first in rank order on a tie."""
    ext = tmp_path / "node" / "cache" / "torch_extensions"
    libs = {}
    for op in ("fused_adam", "cpu_adam"):
        (ext / op).mkdir(parents=True)
        (ext / op / f"{op}.so").write_bytes(b"\x7fELF")
        libs[op] = {"sha256": hashlib.sha256(b"\x7fELF").hexdigest()}
    (tmp_path / "warm.json").write_text(json.dumps({"libs": libs}))
    ops = recorded_ops(str(ext), str(tmp_path / "warm.json"))
    assert ops == ["cpu_adam", "fused_adam"]

    def kinds(cpus, caps=("9.0",) * 4, built=()):
        hostvars, groups, probes = cluster(n=len(cpus))
        for i, (name, p) in enumerate(probes.items()):
            p.update(cpu=cpus[i], gpus=[{"index": "0", "compute_cap": caps[i], "driver": "580.1"}],
                     installed={"ops": ops if name in built else []})
        p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, now="20261130-000000")
        assert errors == []
        return [(p["node"][n]["ops_kind"], p["node"][n]["ops_source"]) for n in groups["cluster"]]

    same = kinds(["a"] * 4)
    assert len({k for k, _ in same}) == 1 and {s for _, s in same} == {"node1"}
    # node3 has them built, the master none: the master builds all the same, for its kind
    assert {s for _, s in kinds(["a"] * 4, built=("node3",))} == {"node1"}
    # another CPU, or another GPU arch: a kind of its own, its own source
    two = kinds(["a", "b", "a", "b"])
    assert two[0][0] != two[1][0] and [s for _, s in two] == ["node1", "node2", "node1", "node2"]
    arch = kinds(["a"] * 4, caps=("9.0", "9.0", "8.0", "8.0"))
    assert [s for _, s in arch] == ["node1", "node1", "node3", "node3"]
    # in a kind without the master, the node whose warm-up built the most ships
    arch = kinds(["a"] * 4, caps=("9.0", "8.0", "8.0", "8.0"), built=("node4",))
    assert [s for _, s in arch] == ["node1", "node4", "node4", "node4"]
    # versions are part of the kind: the same nodes with another DeepSpeed make other kinds
    hostvars, groups, probes = cluster(n=1, dsc_deepspeed_version="0.19.7")
    p, _ = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, now="20261130-000000")
    hostvars, groups, probes = cluster(n=1)
    q, _ = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, now="20261130-000000")
    assert p["node"]["node1"]["ops_kind"] != q["node"]["node1"]["ops_kind"]
