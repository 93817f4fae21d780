"""What a node reports and checks (node/dscnode probe, checks) on this machine: interfaces and runs,
the running firewall, who owns an existing interpreter (and the plan's judgement of it), every
path root writes with its chain and links never followed, free ports, and preflight's TCP
listener.

    .venv/bin/pytest tests/unit/test_node_probe.py -q
"""
import hashlib
import json
import os
import pwd
import socket
import sys
import threading
import time

import pytest

import dscplan
from dscnode import ROOT_STATE, checks, probe, warm_record
from tests.unit.node_helpers import helper


def test_probe_reports_interfaces_and_runs(tmp_path):
    (tmp_path / "r1").mkdir()
    out = json.loads(helper("probe", "--run-root", tmp_path).stdout)
    assert "lo" in out["interfaces"] and isinstance(out["gpus"], list) and out["cpus"] >= 1
    assert [r["id"] for r in out["runs"]] == ["r1"]


def sysfs(root, files):
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text + "\n")


def test_the_probe_reads_each_rdma_port_and_the_roce_v2_gid_that_holds_an_ipv4_address(tmp_path):
    """/sys/class/infiniband as the kernel lays it out (no RDMA device here: a copy of its
    files): an InfiniBand port up, one down, and a RoCE port whose IPv4 GID is index 3."""
    sysfs(tmp_path, {
        "mlx5_0/ports/1/state": "4: ACTIVE", "mlx5_0/ports/1/link_layer": "InfiniBand",
        "mlx5_0/ports/1/rate": "200 Gb/sec (4X HDR)",
        "mlx5_1/ports/1/state": "1: DOWN", "mlx5_1/ports/1/link_layer": "InfiniBand",
        "mlx5_1/ports/1/rate": "10 Gb/sec (4X SDR)",
        "mlx5_2/ports/1/state": "4: ACTIVE", "mlx5_2/ports/1/link_layer": "Ethernet",
        "mlx5_2/ports/1/rate": "100 Gb/sec (2X HDR)",
        **{f"mlx5_2/ports/1/gid_attrs/types/{i}": kind
           for i, kind in enumerate(["IB/RoCE v1", "RoCE v2", "IB/RoCE v1", "RoCE v2"])},
        "mlx5_2/ports/1/gids/0": "fe80:0000:0000:0000:0a42:a1ff:fe2b:0c1e",
        "mlx5_2/ports/1/gids/1": "fe80:0000:0000:0000:0a42:a1ff:fe2b:0c1e",
        "mlx5_2/ports/1/gids/2": "0000:0000:0000:0000:0000:ffff:0a00:0005",
        "mlx5_2/ports/1/gids/3": "0000:0000:0000:0000:0000:ffff:0a00:0005"})
    assert probe.rdma(str(tmp_path)) == [
        {"device": "mlx5_0", "port": 1, "state": "ACTIVE", "link_layer": "InfiniBand", "rate_gbps": 200.0},
        {"device": "mlx5_1", "port": 1, "state": "DOWN", "link_layer": "InfiniBand", "rate_gbps": 10.0},
        {"device": "mlx5_2", "port": 1, "state": "ACTIVE", "link_layer": "Ethernet", "rate_gbps": 100.0, "gid_index": 3}]
    assert probe.rdma(str(tmp_path / "none")) == []


def test_the_probe_reads_each_interfaces_stated_speed(tmp_path):
    """/sys/class/net as the kernel lays it out: a NIC's speed in Mbit/s; -1 where it is down or
    not stated, and no file at all (loopback: EINVAL on read, here missing) are left out."""
    sysfs(tmp_path, {"eth0/speed": "25000", "eth1/speed": "-1", "ib0/speed": "200000", "lo/mtu": "65536"})
    assert probe.link_speeds(str(tmp_path)) == {"eth0": 25000, "ib0": 200000}
    assert probe.link_speeds(str(tmp_path / "none")) == {}


@pytest.mark.parametrize("release,ufw_conf,comms,want", [
    ('ID=debian\n', "ENABLED=yes\n", ["sshd", "bash"], {"os": ["debian"], "ufw": True, "firewalld": False}),
    ('ID="rocky"\nID_LIKE="rhel centos fedora"\n', "", ["systemd", "firewalld"],
     {"os": ["rocky", "rhel", "centos", "fedora"], "ufw": False, "firewalld": True}),
    ('ID=ubuntu\nID_LIKE=debian\n', "# ENABLED=yes\nENABLED=no\n", ["firewalld-helper"],
     {"os": ["ubuntu", "debian"], "ufw": False, "firewalld": False}),
    (None, None, [], {"os": [], "ufw": False, "firewalld": False}),
])
def test_the_probe_reads_the_running_firewall_from_files(tmp_path, release, ufw_conf, comms, want):
    """The probe's firewall view (the plan refuses the other firewall from it): /etc/os-release,
    ufw's ENABLED in /etc/ufw/ufw.conf, and a process named firewalld in /proc; and for ufw.yml,
    IPv6 in the kernel and ufw's rule files."""
    if release is not None:
        (tmp_path / "etc" / "ufw").mkdir(parents=True)
        (tmp_path / "etc" / "os-release").write_text(release)
        (tmp_path / "etc" / "ufw" / "ufw.conf").write_text(ufw_conf)
    for pid, comm in enumerate(comms, start=1):
        (tmp_path / "proc" / str(pid)).mkdir(parents=True)
        (tmp_path / "proc" / str(pid) / "comm").write_text(comm + "\n")
    (tmp_path / "proc" / "sys" / "net" / "ipv6").mkdir(parents=True)
    if release is not None:
        (tmp_path / "etc" / "ufw" / "user.rules").write_text("*filter\n### tuple ### allow tcp 22\n")
    rules = ["*filter\n### tuple ### allow tcp 22\n" if release is not None else "", ""]
    assert probe.firewalls(tmp_path) == dict(want, ipv6=True, ufw_rules=rules)


def test_the_probe_reports_who_owns_an_existing_interpreter_and_the_plan_judges_it(tmp_path):
    """probe --existing-python: owner and mode of the interpreter, every directory above it as
    written and as resolved (a venv's bin/python links to its base), and its lib directories,
    read with lstat; the plan runs it as root only when all are root's and none is writable by
    group or others, else as its one owner, else refuses."""
    env = tmp_path / "opt" / "env"
    (env / "bin").mkdir(parents=True)
    (env / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    (env / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    for d in (tmp_path, tmp_path / "opt", env, env / "bin", env / "lib"):
        d.chmod(0o755)
    py = str(env / "bin" / "python")
    out = json.loads(helper("probe", "--existing-python", py).stdout)["existing_python"]
    paths = [e["path"] for e in out["entries"]]
    assert paths[:1] == ["/"] and py in paths and os.path.realpath(sys.executable) in paths
    assert str(env / "lib" / "python3.11" / "site-packages") in paths
    assert next(e for e in out["entries"] if e["path"] == py)["kind"] == "link"
    me = __import__("pwd").getpwuid(os.geteuid()).pw_name
    owner, problem = dscplan.existing_owner("node1", py, out)
    assert problem is None and owner == ("root" if os.geteuid() == 0 else me)
    (env / "lib" / "python3.11" / "site-packages").chmod(0o775)
    owner, problem = dscplan.existing_owner("node1", py, probe.path_owners(py))
    assert owner is None and f"{env}/lib/python3.11/site-packages is writable by group (mode 775" in problem
    (env / "lib" / "python3.11" / "site-packages").chmod(0o755)
    if os.geteuid() == 0:  # a user's env: run as that user only
        nobody = pwd.getpwnam("nobody")
        for d in (env, env / "bin"):
            os.chown(d, nobody.pw_uid, nobody.pw_gid)
        assert dscplan.existing_owner("node1", py, probe.path_owners(py)) == ("nobody", None)
    assert "error" in probe.path_owners(str(tmp_path / "none" / "bin" / "python"))


def test_probe_reports_each_root_path_and_its_chain_with_links_never_followed(tmp_path):
    """The probe's root_paths: every path root creates or writes into, each directory above it
    read with lstat; a planted link is reported with its target and the chain stops there."""
    victim = tmp_path / "victim"
    victim.mkdir()
    root = tmp_path / "inst"
    root.mkdir()
    (root / "cache").symlink_to(victim)
    out = json.loads(helper("probe", "--run-root", root / "runs", "--install-root", root,
                            "--data-dir", tmp_path / "data", "--train-user", "nobody-here").stdout)
    by_path = {e["path"]: e for e in out["root_paths"]}
    cache = by_path[f"{root}/cache"]
    assert cache["var"] == "dsc_install_root" and cache["role"] == "user"
    assert [c["path"] for c in cache["chain"]][-2:] == [str(root), f"{root}/cache"]
    assert cache["chain"][-1]["kind"] == "link" and cache["chain"][-1]["target"] == str(victim)
    ext = by_path[f"{root}/cache/torch_extensions"]["chain"]
    assert ext[-1]["path"] == f"{root}/cache" and ext[-1]["kind"] == "link"  # never followed below
    assert by_path[str(root)]["role"] == "made" and by_path[str(root)]["chain"][-1]["kind"] == "dir"
    assert by_path[f"{root}/runs"]["chain"][-1]["kind"] == "missing"
    assert by_path[str(tmp_path / "data")]["var"] == "dsc_data_dir"
    assert by_path["/usr/local/lib/dscluster"]["role"] == "root"
    assert not any(e["var"] == "dsc_train_user" for e in out["root_paths"])  # no such user: no home


def test_root_paths_name_the_ssh_files_of_the_training_users_home():
    paths = {e["path"]: e["var"] for e in probe.root_paths("/opt/d/", "/opt/d/runs", "", "/home/u")}
    assert paths["/opt/d"] == "dsc_install_root" and paths["/opt/d/runs"] == "dsc_run_root"
    assert {p for p, v in paths.items() if v == "dsc_train_user"} == {
        "/home/u/.ssh", "/home/u/.ssh/authorized_keys", "/home/u/.ssh/id_ed25519",
        "/home/u/.ssh/known_hosts", "/home/u/.ssh/config"}


def test_free_port_skips_a_port_in_use():
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen(1)
    busy = s.getsockname()[1]
    try:
        assert checks.free_port(busy, busy) is None
        assert checks.free_port(busy, busy + 1) in (busy + 1, None)
    finally:
        s.close()


def test_the_preflight_listener_counts_connections_and_goes_at_a_release():
    """preflight's TCP check on loopback: a node's connection is seen; a release (sent once every
    node's attempt has ended) ends the listener at once, not at its timeout, and is not a node."""
    port = checks.free_port(29600, 29700)
    out = {}
    listener = threading.Thread(target=lambda: out.update(checks.listen({"port": port, "expect": 2, "seconds": 30})))
    t0 = time.time()
    listener.start()
    time.sleep(0.3)
    assert checks.connect({"host": "127.0.0.1", "port": port, "timeout": 3})["ok"]
    assert checks.connect({"host": "127.0.0.1", "port": port, "timeout": 3, "release": True})["ok"]
    listener.join(10)
    assert not listener.is_alive() and time.time() - t0 < 5
    assert out == {"port": port, "seen": ["127.0.0.1"]}


def test_tree_digest_is_what_rsync_compares_and_never_follows_a_link(tmp_path):
    """Two folders with the same files (path, size, whole-second mtime) have one digest; a file's
    size or time, or a file more, changes it; links inside are neither followed nor counted, and a
    folder that is a link has none."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "sub").mkdir(parents=True)
        (d / "x.whl").write_text("wheel")
        (d / "sub" / "y").write_text("y")
        for f in (d / "x.whl", d / "sub" / "y"):
            os.utime(f, (1_700_000_000.4, 1_700_000_000.4))
    assert probe.tree_digest(str(a)) == probe.tree_digest(str(b)) is not None
    os.utime(b / "sub" / "y", (1_700_000_000.9, 1_700_000_000.9))  # the same whole second
    assert probe.tree_digest(str(a)) == probe.tree_digest(str(b))
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "big").write_text("secret")
    (b / "in").symlink_to(tmp_path / "outside")
    (b / "f").symlink_to(tmp_path / "outside" / "big")
    assert probe.tree_digest(str(a)) == probe.tree_digest(str(b))
    os.utime(b / "x.whl", (1_700_000_001, 1_700_000_001))
    assert probe.tree_digest(str(a)) != probe.tree_digest(str(b))
    (tmp_path / "link").symlink_to(a)
    assert probe.tree_digest(str(tmp_path / "link")) is None and probe.tree_digest(str(tmp_path / "none")) is None


def test_what_root_reads_is_bounded_in_entries_and_bytes_and_never_below_a_users_link(tmp_path, monkeypatch):
    """A wheelhouse of empty folders counts against the limit as files do; a file that reads
    longer than its size said (as /proc's do, or one grown while read) is cut at its limit and
    refused; a path with a link another user made in it is not read below, while a link of
    root's in a directory of root's (the system's /opt -> /var/opt) is the path's own."""
    many = tmp_path / "many"
    for i in range(6):
        (many / f"d{i}").mkdir(parents=True)
    monkeypatch.setattr(probe, "WHEELHOUSE_FILES", 5)
    assert probe.tree_digest(str(many)) is None and "more than 5 entries" in str(probe.REFUSED)
    assert probe.sha256("/proc/self/status", 16) is None and "grew past 16 bytes" in str(probe.REFUSED)
    assert probe.sha256("/proc/self/status", 1 << 20) is not None
    (tmp_path / "real" / "runs").mkdir(parents=True)
    (tmp_path / "roots").symlink_to(tmp_path / "real")
    assert probe.unlinked(tmp_path / "roots" / "runs") and probe.unlinked(tmp_path / "real" / "runs")
    os.lchown(tmp_path / "roots", 1000, 1000)  # made by another user
    assert not probe.unlinked(tmp_path / "roots" / "runs") and not probe.unlinked(tmp_path / "missing")


def test_the_probe_names_the_ops_built_its_cpu_and_its_ssh_host_keys(tmp_path):
    """What the plan picks each kind's op source by (the ops root recorded the toolkit's warm-up
    built, the CPU) and what the master's known_hosts pins (the host keys), from real files: an op
    folder the training user planted (not in root's record), a library changed since the record,
    a link or a FIFO where a library was are not counted; a malformed key is left out."""
    ext = tmp_path / "torch_extensions"
    for op in ("fused_adam", "cpu_adam", "planted", "changed", "fifo"):
        (ext / op).mkdir(parents=True)
        (ext / op / f"{op}.so").write_bytes(b"\x7fELF")
    elf = hashlib.sha256(b"\x7fELF").hexdigest()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "linked.so").write_bytes(b"\x7fELF")
    (ext / "linked").mkdir()
    (ext / "linked" / "linked.so").symlink_to(tmp_path / "elsewhere" / "linked.so")
    (tmp_path / "elsewhere" / "dir_linked").mkdir()  # the op's folder a link of the training user's
    (tmp_path / "elsewhere" / "dir_linked" / "dir_linked.so").write_bytes(b"\x7fELF")
    (ext / "dir_linked").symlink_to(tmp_path / "elsewhere" / "dir_linked")
    os.lchown(ext / "dir_linked", 1000, 1000)
    (ext / "changed" / "changed.so").write_bytes(b"\x7fELF, swapped")
    (ext / "fifo" / "fifo.so").unlink()
    os.mkfifo(ext / "fifo" / "fifo.so")
    record = tmp_path / "warm.json"
    record.write_text(json.dumps({"libs": {op: {"sha256": elf} for op in
                                           ("fused_adam", "cpu_adam", "changed", "linked", "dir_linked", "fifo", "../x")}}))
    assert probe.recorded_ops(str(ext), str(record)) == ["cpu_adam", "fused_adam"]
    assert probe.recorded_ops(str(tmp_path / "missing"), str(record)) == []
    assert probe.recorded_ops(str(ext), str(tmp_path / "no-record.json")) == []

    def cpu(model, flags):
        f = tmp_path / "cpuinfo"
        f.write_text(f"processor\t: 0\nmodel name\t: {model}\nflags\t\t: {flags}\ncpu MHz\t\t: {len(flags)}\n\n"
                     f"processor\t: 1\nmodel name\t: other\n")
        return probe.cpu_identity(str(f))
    assert cpu("EPYC 9654", "avx2 avx512f") == cpu("EPYC 9654", "avx2 avx512f")
    assert cpu("EPYC 9654", "avx2") != cpu("EPYC 9654", "avx2 avx512f") != cpu("Xeon 8480", "avx2 avx512f")

    ssh = tmp_path / "ssh"
    ssh.mkdir()
    (ssh / "ssh_host_ed25519_key.pub").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIP4H root@node1\n")
    (ssh / "ssh_host_ecdsa_key.pub").write_text("ecdsa-sha2-nistp256 AAAA$(reboot)\n")
    assert probe.ssh_host_keys(str(ssh)) == ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIP4H"]


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root (CI runs the suite as root)")


@needs_root
def test_the_probe_walks_an_existing_env_whole_and_names_what_another_user_could_change(tmp_path):
    """dscnode.probe.foreign_inside over a real env tree: all root's passes; a package directory
    of another user's, a file writable by group, a link to a file others may write are each named
    (what root's pip and the ranks would import); a sticky directory and the env's own links are
    fine."""
    env = tmp_path / "env"
    site = env / "lib" / "python3.11" / "site-packages"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("")
    (env / "lib64").symlink_to("lib")
    (env / "tmp").mkdir(mode=0o1777)
    (env / "tmp").chmod(0o1777)
    assert probe.foreign_inside(str(env), 0) is None
    os.chown(site / "torch", 65534, 65534)
    assert probe.foreign_inside(str(env), 0) == {"path": str(site / "torch"), "uid": 65534, "why": "owned by another user"}
    assert probe.foreign_inside(str(env), 65534) is None  # the env of that user's: theirs to change
    os.chown(site / "torch", 0, 0)
    (site / "torch" / "__init__.py").chmod(0o664)
    assert probe.foreign_inside(str(env), 0)["why"] == "writable by group (mode 664)"
    (site / "torch" / "__init__.py").chmod(0o644)
    outside = tmp_path / "elsewhere.py"
    outside.write_text("")
    outside.chmod(0o666)
    (site / "zz.py").symlink_to(outside)
    found = probe.foreign_inside(str(env), 0)
    assert found["path"] == str(outside) and found["why"] == f"the target of {site / 'zz.py'}: writable by group and others (mode 666)"
    assert probe.foreign_inside(str(env), 0, limit=3)["why"] == "a tree of more than 3 entries, not all checked"


@needs_root
def test_a_process_named_firewalld_counts_only_where_root_runs_it(tmp_path):
    """Any user can name a process firewalld: the probe counts one only when its /proc entry is
    root's (the plan would refuse ufw, and provision, on a stranger's say-so)."""
    (tmp_path / "proc" / "7").mkdir(parents=True)
    (tmp_path / "proc" / "7" / "comm").write_text("firewalld\n")
    assert probe.firewalls(tmp_path)["firewalld"] is True
    os.chown(tmp_path / "proc" / "7", 65534, 65534)
    assert probe.firewalls(tmp_path)["firewalld"] is False


def test_an_iperf3_port_someone_else_holds_is_named_not_measured():
    """preflight's and doctor.yml's iperf3 server (checks.iperf_server): where another process
    listens on the port, no server of ours starts and its owner is named; the pair's client is
    then not run (dsc_iperf_result says why)."""
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    port = squatter.getsockname()[1]
    try:
        me = pwd.getpwuid(os.getuid()).pw_name
        assert {"uid": os.getuid()} == {k: v for k, v in checks.listeners(port)[0].items() if k == "uid"}
        # our own listener, as a server of the last round ending: waited for (wait_s), then named
        started = time.monotonic()
        out = checks.iperf_server({"port": port, "addr": "127.0.0.1", "seconds": 5, "wait_s": 0.5})
        assert out["listening"] is False and time.monotonic() - started >= 0.5
        assert f"port {port} on {socket.gethostname()}: another process listens on it already; it is held by a process of {me}" in out["error"]
    finally:
        squatter.close()
    assert checks.listeners(port) == []


def test_each_jit_cache_has_a_warm_record_of_its_own_in_roots_directory():
    """A provision of a second install root on a node (another env, another cache) leaves the
    first one's record be: the next provision of the first still answers from it."""
    first, second = warm_record("/opt/dscluster/cache/torch_extensions"), warm_record("/srv/other/cache/torch_extensions")
    assert first != second and first.startswith(f"{ROOT_STATE}/warm/") and first.endswith(".json")
    paths = {e["path"]: e["role"] for e in probe.root_paths("/opt/dscluster", "", "", "")}
    assert paths[first] == "root" and second not in paths
