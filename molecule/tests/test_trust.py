"""The training user hostile, and another local user beside it, on the container cluster: what root
installs, reads and runs is never theirs to write (docs/security.md). Each test proves that what
must not change did not.

- An existing env of root's with dsc_existing_install (the GPU benchmarks' layout): the training
  user replaces the lock in the install root and drops a wheel in its wheelhouse; root's pip
  installs from root's own folder, and nothing of theirs is installed or runs. A package directory
  of another user's inside that env is refused before any change.
  That provision also finds no rsync on one node, with OS packages unmanaged (an image as it
  comes): the wheelhouse goes there as one tar archive, each file's time kept as rsync keeps it.
- Files the probe reads as root, replaced by a FIFO and a sparse 1 TiB file while a run trains:
  every playbook returns in its usual time, names each file, and stop.yml still stops the run."""
import base64
import hashlib
import io
import json
import time
import zipfile

from cluster import HELPER, TINY, UNTIL_STOPPED, WHEELHOUSE, wait
from dscnode import warm_record
from dscnode.probe import tree_digest

ROOT_ENV = "/opt/rootenv"
SITE = f"{ROOT_ENV}/lib/python3.11/site-packages"
MARK = "/tmp/planted-wheel-ran"
INSTALL = "/opt/dscluster"
ROOT_PACKAGES = "/var/lib/dscluster/packages"
WARM_RECORD = warm_record(f"{INSTALL}/cache/torch_extensions")  # the cluster's own warm-up's


def planted_wheel():
    """(file name, bytes, sha256) of a wheel whose .pth records the uid of every interpreter start
    of the env it lands in: what the training user would like root to install."""
    name, files = "dsc_planted-1.0", {"dsc_planted.pth": f"import os; open('{MARK}', 'a').write(str(os.getuid()) + chr(10))\n"}
    files[f"{name}.dist-info/METADATA"] = "Metadata-Version: 2.1\nName: dsc-planted\nVersion: 1.0\n"
    files[f"{name}.dist-info/WHEEL"] = "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},{len(text)}"
              for path, text in files.items()]
    files[f"{name}.dist-info/RECORD"] = "\n".join(record + [f"{name}.dist-info/RECORD,,"]) + "\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    data = buf.getvalue()
    return f"{name}-py3-none-any.whl", data, hashlib.sha256(data).hexdigest()


def root_env_settings():
    """The inventory's env as the GPU benchmarks' (an interpreter of root's, installed into), their
    image's OS packages as they come, and no op warmed: the env's copy would rebuild every op for
    its own paths, which this does not test."""
    return ["-e", json.dumps({"dsc_env_manager": "existing", "dsc_existing_python": f"{ROOT_ENV}/bin/python",
                              "dsc_existing_install": True, "dsc_manage_packages": False,
                              "deepspeed_warm_ops": {"cpu": [], "cuda": []}})]


RSYNC = "/usr/bin/rsync"


def test_root_installs_nothing_the_training_user_planted(provisioned, cluster, tmp_path):
    wheel, data, sha = planted_wheel()
    (tmp_path / wheel).write_bytes(data)
    kept = "/tmp/trust-kept"  # the cluster's own lock and warm-up record, put back after
    for n in cluster.names:
        cluster.exec(n, f"rm -rf {kept} && mkdir {kept} && cp -a {INSTALL}/lock-wheels.txt {WARM_RECORD} {kept}/")
    try:
        for n in cluster.names:
            # A copy of the node's env made root's alone, lacking one package of the lock (py-spy):
            # provision's pip runs, as root, into it.
            cluster.exec(n, f"rm -rf {ROOT_ENV} {MARK} && cp -a {INSTALL}/env {ROOT_ENV} && chown -R root:root {ROOT_ENV} "
                            f"&& chmod -R a+rX,go-w {ROOT_ENV} && grep -rlI '{INSTALL}/env/bin/python' {ROOT_ENV}/bin "
                            f"| xargs sed -i 's#{INSTALL}/env/bin/python#{ROOT_ENV}/bin/python#' "
                            f"&& {ROOT_ENV}/bin/python -m pip uninstall -q -y py-spy")
            cluster.copy_to(n, tmp_path / wheel, f"/tmp/{wheel}")
            cluster.exec(n, f"cp /tmp/{wheel} {INSTALL}/wheelhouse/ && "
                            f"(cat {INSTALL}/lock-wheels.txt; echo 'dsc-planted==1.0 --hash=sha256:{sha}') > /tmp/lock && "
                            f"cp /tmp/lock {INSTALL}/lock-wheels.txt", user="dstrain")
        planted = {n: cluster.exec(n, f"sha256sum {INSTALL}/lock-wheels.txt {INSTALL}/wheelhouse/{wheel}").stdout
                   for n in cluster.names}
        worker = cluster.names[1]
        cluster.exec(worker, f"mv {RSYNC} {RSYNC}.hidden")
        r = cluster.playbook("provision.yml", *root_env_settings())
        assert r.returncode == 0, r.output[-6000:]
        # root's wheelhouse: by rsync to the master, as one tar archive to the worker, the same files
        # and times on both (what the probe compares: the next provision sends nothing)
        by_tar = r.output.split("Unpack the offline wheelhouse on the nodes without rsync")[1].split("TASK [")[0]
        assert f"changed: [{worker}]" in by_tar and f"skipping: [{cluster.master}]" in by_tar, by_tar
        digest = f"PYTHONPATH={HELPER} python3 -c 'from dscnode.probe import tree_digest; print(tree_digest(\"{ROOT_PACKAGES}/wheelhouse\"))'"
        assert {n: cluster.exec(n, digest).stdout.strip() for n in cluster.names} == \
            {n: tree_digest(WHEELHOUSE) for n in cluster.names}
        for n in cluster.names:
            have = cluster.exec(n, f"ls {SITE}").stdout.split()
            assert not [x for x in have if "planted" in x], (n, have)
            assert any(x.startswith("py_spy-") for x in have), (n, "root's pip did not run")
            assert cluster.exec(n, f"test -e {MARK}", check=False).returncode != 0, cluster.exec(n, f"cat {MARK}").stdout
            owners = cluster.exec(n, f"stat -c '%U %a' {ROOT_PACKAGES} {ROOT_PACKAGES}/lock-wheels.txt {ROOT_PACKAGES}/wheelhouse").stdout
            assert owners.split("\n")[:3] == ["root 755", "root 644", "root 755"], owners
            assert "planted" not in cluster.exec(n, f"cat {ROOT_PACKAGES}/lock-wheels.txt; ls {ROOT_PACKAGES}/wheelhouse").stdout
            # what the training user planted is theirs, left as it was: never read by root
            assert cluster.exec(n, f"sha256sum {INSTALL}/lock-wheels.txt {INSTALL}/wheelhouse/{wheel}").stdout == planted[n]

        # Another user's package directory inside the env: refused before any change.
        cluster.exec(cluster.names[1], f"id eve >/dev/null 2>&1 || useradd -m eve; chown -R eve {SITE}/pip")
        refused = cluster.playbook("provision.yml", *root_env_settings())
        assert refused.returncode != 0, refused.output[-3000:]
        assert (f"dsc_existing_python on host {cluster.names[1]} is '{ROOT_ENV}/bin/python': {SITE}/pip is owned by "
                f"another user (eve), inside what the env imports") in refused.output, refused.output[-3000:]
        assert "Make every node identical" not in refused.output
        assert all(v.get("changed", 0) == 0 for v in refused.recap.values()), refused.recap
    finally:  # the cluster's own env again: its lock in the install root, the warm-up's record its own
        cluster.exec(cluster.names[1], f"test -e {RSYNC} || mv {RSYNC}.hidden {RSYNC}", check=False)
        for n in cluster.names:
            cluster.exec(n, f"rm -rf {ROOT_ENV} {ROOT_PACKAGES} {MARK} /tmp/{wheel} {INSTALL}/wheelhouse/{wheel}; "
                            f"cp -a {kept}/lock-wheels.txt {INSTALL}/ && cp -a {kept}/{WARM_RECORD.rsplit('/', 1)[1]} {WARM_RECORD} && rm -rf {kept}",
                         check=False)


def test_fifos_and_sparse_files_where_root_reads_are_named_and_stop_still_stops(provisioned, cluster, figures):
    """While a run trains, the training user replaces what the probe reads as root on the master:
    the run's memory.jsonl with a FIFO (reading it blocked the probe until killed) and the lock in
    the install root with a sparse 1 TiB file (hashing it ran out of memory on every playbook).
    status, runs and stop return in their usual time naming both; stop ends every rank."""
    run = "trust-fifo"
    r = cluster.playbook("launch.yml", "-e", f"run_id={run}", "-e", "preflight=false",
                         "-e", json.dumps({"dsc_train_config": dict(TINY, **UNTIL_STOPPED)}))
    assert r.returncode == 0, r.output[-4000:]
    stopped = False
    try:
        wait(lambda: cluster.rank_pids(cluster.master, run), 120, "the run's ranks")
        cluster.exec(cluster.master, f"cd {INSTALL}/runs/{run} && rm -f memory.jsonl && mkfifo memory.jsonl && "
                                     f"cd {INSTALL} && mv lock-wheels.txt lock-wheels.saved && truncate -s 1T lock-wheels.txt",
                     user="dstrain")
        seconds = {}
        for playbook in ("status.yml", "runs.yml", "stop.yml"):
            started = time.time()
            out = cluster.playbook(playbook, "-e", f"run_id={run}", timeout=300)
            seconds[playbook] = round(time.time() - started, 1)
            assert out.returncode == 0, (playbook, out.output[-4000:])
            for needle in (f"{INSTALL}/runs/{run}/memory.jsonl was left unread: a FIFO, not a regular file",
                           f"{INSTALL}/lock-wheels.txt was left unread: 1,099,511,627,776 bytes, more than a file of its kind may hold"):
                assert f"host {cluster.master}: {needle}" in out.output, (playbook, needle, out.output[-4000:])
            stopped = stopped or playbook == "stop.yml"
        for n in cluster.names:
            assert cluster.rank_pids(n, run) == [], n
        figures("hostile files where root reads", seconds=seconds)
    finally:
        if not stopped:
            cluster.playbook("stop.yml", "-e", f"run_id={run}")
        cluster.exec(cluster.master, f"rm -f {INSTALL}/runs/{run}/memory.jsonl; cd {INSTALL} && "
                                     f"test -e lock-wheels.saved && mv -f lock-wheels.saved lock-wheels.txt", check=False)
