"""provision.yml on the container cluster: what each node ends with (idempotence, and the env's
owner, its versions as the training user imports them and the base packages on every node:
molecule verify, test_molecule.py).
The nodes start from the provisioned image (molecule/cluster.py): one node provisioned from the
bare image through provision.yml and committed; the cluster's own provision.yml then runs on
every node ("bare" and "cluster" in the `provisioned` fixture's outputs)."""
import json
import os
import shutil
import subprocess
import sys

from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename

from cluster import EXT_DIR, OUTSIDER, OUTSIDER_IP, PINS, ROOT, TEST_PACKAGES, WHEELHOUSE, lock_pins
from dscnode import warm_record


def test_version_table_has_a_row_per_node(provisioned, cluster):
    for out, nodes in ((provisioned["bare"], cluster.names[:1]), (provisioned["cluster"], cluster.names)):
        for name in nodes:
            assert f'"{name} | 3.11' in out and f"| {PINS['TORCH_VERSION']}+cpu | cpu | {PINS['DEEPSPEED_VERSION']} |" in out


def test_ds_report_kept_and_jit_cache_warm(provisioned, cluster):
    libs = {}
    for name in cluster.names:
        host = cluster.host(name)
        report = host.file("/opt/dscluster/ds_report.txt")
        assert report.exists and "DeepSpeed general environment info" in report.content_string
        out = host.run(f"cd {EXT_DIR} && stat -c '%n %Y' */*.so").stdout
        libs[name] = dict(line.split() for line in out.splitlines())
        assert any("shm_comm" in p for p in libs[name]) and any("fused_adam" in p for p in libs[name]), libs
        # the warm-up's record of its complete answer (a provision that changes nothing answers from
        # it), kept by root where the training user cannot change it, each library by its sha256
        record = host.file(warm_record(EXT_DIR))
        assert (record.user, record.mode) == ("root", 0o644) and not host.file("/opt/dscluster/warm.json").exists
        kept = json.loads(record.content_string)
        assert kept["out"]["ops"] == ["deepspeed_shm_comm", "fused_adam"] and len(kept["libs"]["fused_adam"]["sha256"]) == 64
    # Built once, on the image's node; in the cluster's provision node1 found them built and the
    # others (their cache emptied by the fixture) got node1's build, loaded without a build: the
    # same libraries with the same times, and no warm-up changed anything.
    def task(out, name):
        return out.split(f"TASK [deepspeed : {name}")[1].split("TASK [")[0]
    assert f"changed: [{cluster.master}]" in task(provisioned["bare"], "Warm the JIT op cache")
    first = task(provisioned["cluster"], "Warm the JIT op cache")
    assert all(f"ok: [{n}]" in first for n in cluster.names) and "changed:" not in first, first
    others = cluster.names[1:]
    assert f"changed: [{cluster.master}]" in task(provisioned["cluster"], "Pack the ops on each kind's source node")
    unpacked = task(provisioned["cluster"], "Unpack the source's ops on the nodes that await them")
    assert all(f"changed: [{n}]" in unpacked for n in others) and f"skipping: [{cluster.master}]" in unpacked, unpacked
    shipped = task(provisioned["cluster"], "Warm the shipped ops")
    assert all(f"ok: [{n}]" in shipped for n in others) and "changed:" not in shipped, shipped
    assert all(libs[n] == libs[cluster.master] for n in others), libs


def test_conda_manager_checks_a_pushed_installer_before_running_it(provisioned, cluster, tmp_path):
    """As far as this machine allows without Miniconda: the air-gapped path pushes the installer to
    every node and refuses it when its sha256 differs (the download path's get_url checks the same
    sha256 itself; installing and creating the env need the real installer)."""
    fake = tmp_path / "Miniconda3-latest-Linux-x86_64.sh"
    fake.write_text("#!/bin/sh\necho 'not Miniconda'\nexit 1\n")
    extra = {"dsc_env_manager": "conda", "dsc_conda_installer_file": str(fake), "dsc_conda_installer_sha256": "0" * 64}
    try:
        r = cluster.playbook("provision.yml", "-e", json.dumps(extra))
        assert r.returncode != 0
        assert "Push the Miniconda installer from the control node" in r.output
        for node in cluster.names:
            assert f"dsc_conda_installer_file on host {node}" in r.output and "not dsc_conda_installer_sha256" in r.output
            cluster.exec(node, "test -f /opt/dscluster/cache/miniconda-installer.sh")
        assert "Install Miniconda in batch mode" not in r.output  # never run
    finally:
        for node in cluster.names:
            cluster.exec(node, "rm -f /opt/dscluster/cache/miniconda-installer.sh", check=False)


def test_index_installs_take_exactly_the_hashed_node_lock(provisioned, cluster, tmp_path):
    """Nodes without a wheelhouse install from a package index: here a PEP 503 index served over
    HTTP from the outsider container (the wheelhouse's torch and DeepSpeed dependencies, DeepSpeed's
    source archive as PyPI has it, setuptools and wheel: scripts/test.sh fetches the last two
    before the tests). scripts/nodelock.sh locks it on the control node;
    a file changed on the index is refused on every node before anything is installed; then the
    real install into a fresh install root: the wheels, then DeepSpeed built from its sdist
    without build isolation. JIT op warming is left out (the main provision covers it)."""
    sdist = [f for f in TEST_PACKAGES.glob("*") if f.name.startswith(("deepspeed-", "wheel-"))]
    assert len(sdist) == 2, f"{TEST_PACKAGES} lacks DeepSpeed's source archive or wheel: scripts/test.sh fetches them"
    # The index: one folder per project (canonical name), listed by http.server; DeepSpeed as
    # PyPI has it, a source archive only (the wheelhouse's wheel of it is built there).
    index = tmp_path / "index"
    for f in [w for w in WHEELHOUSE.glob("*.whl") if not w.name.startswith("deepspeed-")] + sdist:
        name = parse_wheel_filename(f.name)[0] if f.suffix == ".whl" else parse_sdist_filename(f.name)[0]
        (index / "simple" / canonicalize_name(name)).mkdir(parents=True, exist_ok=True)
        shutil.copy(f, index / "simple" / canonicalize_name(name) / f.name)
    url = f"http://{OUTSIDER_IP}:8000/simple/"
    podman = dict(env=dict(os.environ), check=True, capture_output=True)
    subprocess.run(["podman", "exec", OUTSIDER, "rm", "-rf", "/srv/index"], **podman)
    subprocess.run(["podman", "cp", str(index), f"{OUTSIDER}:/srv/index"], **podman)
    subprocess.run(["podman", "exec", "-d", OUTSIDER, "python3", "-m", "http.server", "8000", "--bind",
                    OUTSIDER_IP, "--directory", "/srv/index"], **podman)
    lock = tmp_path / "nodes.lock"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "nodelock.sh"), str(lock)], capture_output=True, text=True,
                       env=dict({k: v for k, v in os.environ.items() if not k.startswith("PIP_")},
                                PIP_CONFIG_FILE=os.devnull, INDEX_URL=url, PYTHON=sys.executable), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = lock.read_text().splitlines()
    assert f"deepspeed=={PINS['DEEPSPEED_VERSION']}" in "\n".join(lines)
    assert [line.split("==")[0] for line in lines if line.endswith("# sdist")] == ["deepspeed"], lines
    root = "/opt/dsc-index"
    # dsc_torch_variant pypi: torch comes from this index too (no download.pytorch.org beside it)
    extra = ["-e", json.dumps({"dsc_wheelhouse": "", "dsc_requirements_file": "", "dsc_install_root": root,
                               "dsc_torch_variant": "pypi",
                               "dsc_node_lock": str(lock), "dsc_pip_index_url": url,
                               "deepspeed_warm_ops": {"cpu": [], "cuda": []}})]
    # The lock's first file changed on the index: pip checks each file as it fetches it, in the
    # lock's order, so the refusal comes before torch's 800 MB are fetched on every node.
    first = canonicalize_name(next(line for line in lines if line and not line.startswith("#")).split("==")[0])
    tampered = next((index / "simple" / first).glob("*.whl"))
    try:
        # A changed file on the index: refused on every node, nothing installed in the new env.
        subprocess.run(["podman", "exec", OUTSIDER, "sh", "-c",
                        f"echo tampered >> /srv/index/simple/{first}/{tampered.name}"], **podman)
        r = cluster.playbook("provision.yml", *extra)
        assert r.returncode != 0
        task = r.output.split("Install the lock's wheels, every file checked against its sha256")[1].split("TASK [")[0]
        assert "DO NOT MATCH THE HASHES" in task and tampered.name in task, task[-3000:]
        assert "Task failed" in task and sum(v.get("failed", 0) for v in r.recap.values()) >= 1, r.recap
        assert "Build and install the lock's source packages" not in r.output
        for n in cluster.names:
            assert cluster.exec(n, f"ls {root}/env/lib/python3*/site-packages | grep -c -E '^(torch|{first.replace('-', '_')})' "
                                   "|| true").stdout.strip() == "0"
        # The index's own file again: the lock installs, DeepSpeed built from its source archive.
        subprocess.run(["podman", "cp", str(tampered), f"{OUTSIDER}:/srv/index/simple/{first}/{tampered.name}"], **podman)
        r = cluster.playbook("provision.yml", *extra)
        assert r.returncode == 0, r.output[-5000:]
        assert "Build and install the lock's source packages, checked against their sha256 (deepspeed)" in r.output
        locked = lock_pins(lock.read_text())
        for n in cluster.names:
            got = cluster.versions(n, f"{root}/env/bin/python", locked)
            assert got == locked, (n, {k: (v, locked[k]) for k, v in got.items() if v != locked[k]})
            cluster.exec(n, f"{root}/env/bin/python -c 'import deepspeed, torch'", user="dstrain")
    finally:
        subprocess.run(["podman", "exec", OUTSIDER, "sh", "-c", "pkill -f 'http.server 8000'; rm -rf /srv/index"],
                       env=dict(os.environ), capture_output=True)
        for n in cluster.names:
            cluster.exec(n, f"rm -rf {root}", check=False)
