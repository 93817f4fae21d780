"""The test cluster: Debian 12 podman containers, each with its own network namespace, hostname,
address and sshd, reached over SSH with a key and a pinned known_hosts, as a user's nodes are.

    python3 molecule/cluster.py up [--nodes 2]     # start (or reuse) the cluster, write its inventory
    python3 molecule/cluster.py down               # remove containers and network
    python3 molecule/cluster.py env                # print the inventory path
    python3 molecule/cluster.py image              # make (or reuse) the provisioned node image
    python3 molecule/cluster.py systemd-layer      # and the systemd layer on it (test_slurm's nodes)

The inventory lands in $DSC_TEST_STATE (default .cache/testcluster, .cache/testcluster1 for the
second cluster: cluster_index)/inventory. Node 2 runs sshd on a non-default port, so that every
test also exercises the port plumbing. A container named `dsc-outsider` sits on the same network
but not in the inventory (for the firewall scope test).
The network carries IPv6 too (a ULA subnet, a fixed address per container, recorded in
cluster.json as ip6): the firewall is checked over both families.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cluster_index():
    """Which cluster this process drives: $DSC_TEST_CLUSTER where set (this file's commands, bench/),
    else the pytest-xdist worker's number ($PYTEST_XDIST_WORKER: gw0 the first cluster, gw1 the
    second), else 0. Each cluster has its own containers' names, network and state, so the
    container tier's two workers (scripts/suite.py runs it with -n 2) each drive their own."""
    if os.environ.get("DSC_TEST_CLUSTER"):
        return int(os.environ["DSC_TEST_CLUSTER"])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") else 0


INDEX = cluster_index()
SUFFIX = str(INDEX) if INDEX else ""
STATE = Path(os.environ.get("DSC_TEST_STATE", ROOT / ".cache" / f"testcluster{SUFFIX}"))
IMAGE = os.environ.get("DSC_IMAGE", "localhost/dscluster-node:bookworm")
# systemd as PID 1 with dbus and firewalld (molecule/node-systemd.Containerfile).
SYSTEMD_IMAGE = os.environ.get("DSC_SYSTEMD_IMAGE", "localhost/dscluster-node:bookworm-systemd")
NETWORK = f"dsc-test{SUFFIX}"
SUBNET = f"10.89.{77 + INDEX}.0/24"
SUBNET6 = f"fd89:{77 + INDEX}::/64"
PREFIX = f"dsc{SUFFIX}-"
# Where provision.yml installs the node helper, and the default run root.
HELPER = "/usr/local/lib/dscluster/dsc_node.pyz"
RUNS = "/opt/dscluster/runs"
EXT_DIR = "/opt/dscluster/cache/torch_extensions"  # the JIT op cache (TORCH_EXTENSIONS_DIR)
OUTSIDER = PREFIX + "outsider"
# train.run's settings for a tiny run that a test ends itself (a stop, a fault, a second launch):
# it steps at most ten times a second (train.run's min_step_s), so that while the test looks at
# it, it leaves the CPU to Ansible and to the other cluster instead of spinning through steps.
UNTIL_STOPPED = {"steps": 100000, "min_step_s": 0.1}
# The tests' model: train.run's tiny GPT with a small vocabulary and short sequences.
TINY = {"vocab_size": 512, "seq_len": 64}


def addr(host):
    """The test network's IPv4 address ending in `host`."""
    return SUBNET.rsplit(".", 1)[0] + f".{host}"


def addr6(host):
    """The test network's IPv6 address ending in `host`."""
    return SUBNET6.split("::")[0] + f"::{host}"


OUTSIDER_IP, OUTSIDER_IP6 = addr(200), addr6(200)
NONDEFAULT_SSH_PORT = 2222
# torch's and DeepSpeed's pinned versions (requirements/pins.env), as the nodes should have them.
# What the tests install beside the wheelhouse (scripts/test.sh fetches it before the tests).
TEST_PACKAGES = Path(os.environ.get("DSC_TEST_PACKAGES", ROOT / ".cache" / "test-packages"))
WHEELHOUSE = Path(os.environ.get("DSC_WHEELHOUSE", ROOT / ".cache" / "wheelhouse"))  # the nodes' wheels (scripts/wheelhouse.sh)
PINS = dict(line.split("=", 1) for line in (ROOT / "requirements" / "pins.env").read_text().splitlines()
            if line.strip() and not line.startswith("#"))
os.environ.setdefault("CONTAINERS_CONF", str(ROOT / "molecule" / "containers.conf"))
# The control venv's tools (ansible-playbook next to the python running this).
VENV_BIN = Path(sys.executable).parent


def sh(*cmd, check=True, capture=True, input=None):
    r = subprocess.run(cmd, check=False, text=True, input=input,
                       stdout=subprocess.PIPE if capture else None,
                       stderr=subprocess.PIPE if capture else None)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr or ''}{r.stdout or ''}")
    return r


# Each running container's id, environment and PID 1 (as the host sees it), read once by `enter`.
_ENTERED: dict[str, tuple[str, list[str], int]] = {}


def _runs_in(pid, cid):
    """Whether host PID `pid` is still in the container whose id is `cid` (its cgroup names it)."""
    try:
        return cid in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False


def enter(name, user=None):
    """argv that runs a command inside a running container as `podman exec [--user]` does (its
    namespaces, the image's environment, the user's own groups and home) without podman's client,
    conmon and runc for every call, which cost the machine over ten times as much CPU as nsenter,
    and a suite makes thousands of such calls. The PID is checked against the container's id on
    every call (a restarted container has a new one); None when the container is not running."""
    for fresh in (False, True):
        if fresh or name not in _ENTERED:
            r = sh("podman", "inspect", "--format", "{{.Id}} {{.State.Pid}} {{json .Config.Env}}", name, check=False)
            if r.returncode != 0:
                return None
            cid, pid, env = r.stdout.strip().split(" ", 2)
            _ENTERED[name] = (cid, json.loads(env), int(pid))
        cid, env, pid = _ENTERED[name]
        if pid and _runs_in(pid, cid):
            return (["nsenter", "--target", str(pid), "--all", "env", "-i", *env]
                    + (["runuser", "-u", user, "--"] if user else []))
    return None


def node_name(i):
    return f"node{i}"


def node_ip(i):
    return addr(10 + i)


def node_ip6(i):
    return addr6(10 + i)


def ssh_port(i):
    return NONDEFAULT_SSH_PORT if i == 2 else 22


def down():
    names = sh("podman", "ps", "-a", "--format", "{{.Names}}", check=False).stdout.split()
    mine = [n for n in names if n.startswith(PREFIX)]
    if mine:
        sh("podman", "rm", "-f", "-t", "0", *mine, check=False)
    sh("podman", "network", "rm", "-f", NETWORK, check=False)
    # Leave the cached image alone; forget the inventory and keys of the old cluster.
    if STATE.exists():
        subprocess.run(["rm", "-rf", str(STATE)], check=False)


# Default capabilities plus what ufw needs: no SYS_PTRACE, as on restricted real nodes (root
# there cannot read other users' /proc/PID/environ; the toolkit must not rely on it).
def start(name, hostname, ip, ip6, port, image=IMAGE, volumes=()):
    """`volumes`: podman's name:path, a folder the nodes started with it share (a shared filesystem)."""
    sh("podman", "run", "-d", "--name", name, "--hostname", hostname, "--env", f"DSC_NODE_ID={name}-{time.time_ns()}",
       *(a for v in volumes for a in ("--volume", v)),
       "--network", NETWORK, "--ip", ip, "--ip6", ip6, "--no-hosts",
       "--cap-add", "NET_ADMIN", "--cap-add", "NET_RAW",
       "--cap-add", "AUDIT_WRITE", "--shm-size", "1g", "--init",
       # A small disk for the tests of full run roots (molecule/tests/test_faults.py).
       "--mount", "type=tmpfs,destination=/mnt/small,tmpfs-size=16m,tmpfs-mode=0755",
       image, "/bin/sh", "-c",
       # Host keys and a hosts file of this container's own (those of the node an image was
       # committed from, on another cluster's network, are replaced; a restart keeps them), then
       # sshd as a daemon: a test can stop sshd alone, as on a real node, or the whole container.
       '[ "$(cat /etc/ssh/.node-id 2>/dev/null)" = "$DSC_NODE_ID" ] || '
       '{ rm -f /etc/ssh/ssh_host_*; echo "$DSC_NODE_ID" > /etc/ssh/.node-id; '
       f"printf '127.0.0.1 localhost\\n{ip} {hostname}\\n' > /etc/hosts; }}; "
       # A firewall the node had is loaded as its boot would (ufw's own boot script).
       "if [ -x /lib/ufw/ufw-init ]; then /lib/ufw/ufw-init start quiet >/dev/null 2>&1; fi; "
       f"ssh-keygen -A && /usr/sbin/sshd -p {port} && exec sleep infinity")


def start_systemd(name, hostname, ip, ip6, image=SYSTEMD_IMAGE):
    """A node of the systemd image on the test network: systemd starts dbus, firewalld and sshd
    (port 22, host keys made at its start). NET_ADMIN is what firewalld needs of the kernel."""
    sh("podman", "run", "-d", "--name", name, "--hostname", hostname,
       "--network", NETWORK, "--ip", ip, "--ip6", ip6,
       "--cap-add", "NET_ADMIN", "--cap-add", "NET_RAW", "--cap-add", "AUDIT_WRITE", image)


@contextlib.contextmanager
def extra_nodes(nodes, where, start, extra=""):
    """More nodes of the test network beside the cluster (its network and control key): each
    started by start(container, node), the control key authorised, their host keys pinned in
    where/known_hosts, their own inventory at where/inventory (with `extra` group settings);
    yields the inventory once SSH answers, and removes the containers after."""
    containers = [PREFIX + h["name"] for h in nodes]
    pub = (STATE / "id_ed25519.pub").read_text()
    try:
        for h, container in zip(nodes, containers, strict=True):
            start(container, h)
        known = [f"{h['ip']} {authorize(c, pub)}" for h, c in zip(nodes, containers, strict=True)]
        (where / "known_hosts").write_text("\n".join(known) + "\n")
        write_inventory(nodes, inv=where / "inventory", known_hosts=where / "known_hosts", extra=extra)
        wait_ssh(nodes, known_hosts=where / "known_hosts")
        yield where / "inventory"
    finally:
        sh("podman", "rm", "-f", "-t", "0", *containers, check=False)


def systemd_tag(base):
    return f"{base}-systemd"


def systemd_image(base):
    """The systemd layer (molecule/node-systemd.Containerfile) on `base` (the provisioned image:
    its env, torch and DeepSpeed's ops), built once per base: `<base>-systemd`. scripts/test.sh
    builds it beside the container tier (`cluster.py systemd-layer`); test_slurm's nodes wait for
    that build under the same lock, or make it."""
    tag = systemd_tag(base)
    (ROOT / ".cache").mkdir(exist_ok=True)
    with open(ROOT / ".cache" / "systemd-layer.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if sh("podman", "image", "exists", tag, check=False).returncode != 0:
            if sh("podman", "image", "exists", base, check=False).returncode != 0:
                raise RuntimeError(f"no image {base} to build the systemd layer on: `cluster.py image` makes it")
            sh("podman", "build", "-q", "--network=host", "--build-arg", f"BASE={base}", "-t", tag,
               "-f", str(ROOT / "molecule" / "node-systemd.Containerfile"), str(ROOT / "molecule"))
    return tag


def authorize(container, pub, timeout=60):
    """The control key in the container's root authorized_keys; its ed25519 host key
    ("type base64"), once sshd's start has made it."""
    sh("podman", "exec", "-i", container, "sh", "-c",
       "mkdir -p -m 700 /root/.ssh && cat > /root/.ssh/authorized_keys && chmod 600 /root/.ssh/authorized_keys",
       input=pub)
    deadline = time.time() + timeout
    while True:
        r = sh("podman", "exec", container, "cat", "/etc/ssh/ssh_host_ed25519_key.pub", check=False)
        if r.returncode == 0 or time.time() > deadline:
            break
        time.sleep(0.2)
    if r.returncode != 0:
        raise RuntimeError(f"{container} has no SSH host key after {timeout} s: {r.stderr}")
    return " ".join(r.stdout.split()[:2])


def up(nodes, image=IMAGE):
    """The cluster of `nodes` nodes started from `image` (reused when one of that shape runs)."""
    if (STATE / "cluster.json").exists():
        info = json.loads((STATE / "cluster.json").read_text())
        running = set(sh("podman", "ps", "--format", "{{.Names}}").stdout.split())
        # A cluster from before the network carried IPv6 (no ip6 recorded) is made again.
        if (info["nodes"] == nodes and info.get("image") == image and all(PREFIX + n["name"] in running and n.get("ip6") for n in info["hosts"])
                and info["outsider"].get("ip6")):
            print(f"reusing cluster of {nodes} nodes: {STATE / 'inventory'}")
            return info
    down()
    STATE.mkdir(parents=True, exist_ok=True)
    sh("podman", "network", "create", "--ipv6", "--subnet", SUBNET, "--subnet", SUBNET6, NETWORK)
    key = STATE / "id_ed25519"
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dsc-test-control", "-f", str(key))
    pub = (STATE / "id_ed25519.pub").read_text()
    hosts = [{"name": node_name(i), "ip": node_ip(i), "ip6": node_ip6(i), "port": ssh_port(i)}
             for i in range(1, nodes + 1)]
    for h in hosts:
        start(PREFIX + h["name"], h["name"], h["ip"], h["ip6"], h["port"], image)
    start(OUTSIDER, "outsider", OUTSIDER_IP, OUTSIDER_IP6, 22)
    known = []
    for h in hosts + [{"name": "outsider", "ip": OUTSIDER_IP, "port": 22}]:
        addr = h["ip"] if h["port"] == 22 else f"[{h['ip']}]:{h['port']}"
        known.append(f"{addr} {authorize(PREFIX + h['name'], pub)}")
    (STATE / "known_hosts").write_text("\n".join(known) + "\n")
    write_inventory(hosts)
    wait_ssh(hosts + [{"name": "outsider", "ip": OUTSIDER_IP, "port": 22}])
    info = {"nodes": nodes, "image": image, "hosts": hosts,
            "outsider": {"name": OUTSIDER, "ip": OUTSIDER_IP, "ip6": OUTSIDER_IP6}}
    (STATE / "cluster.json").write_text(json.dumps(info, indent=1))
    return info


# The provisioned node image: one node of the bare image provisioned through the real
# provision.yml (DeepSpeed's CPU ops built there once) and committed; the test cluster's nodes
# start from it. Its tag is a digest of everything provisioning reads, so a later suite on this
# machine reuses it until one of those changes.
PROVISIONED_REPO = "localhost/dscluster-node"
PROVISION_INPUTS = ("ansible.cfg", "provision.yml", "playbooks", "roles", "plugins", "node", "templates",
                    "requirements", "tests/fixtures/scripts/requirements.txt")


def provision_digest():
    h = hashlib.sha256(sh("podman", "image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.encode())
    files = [ROOT / p for p in PROVISION_INPUTS] + [WHEELHOUSE / "requirements.lock"]
    for top in files:
        for f in sorted([top] if top.is_file() else top.rglob("*")):
            # Callbacks shape only what a playbook prints, never what it installs.
            if f.is_file() and "__pycache__" not in f.parts and not f.is_relative_to(ROOT / "plugins" / "callback"):
                h.update(f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f.name}\0".encode() + f.read_bytes())
    return h.hexdigest()[:16]


def provisioned_tag():
    return f"{PROVISIONED_REPO}:provisioned-{provision_digest()}"


def provisioned_image():
    """(tag, output of the provision.yml that made it): the image made now, or the one a suite
    made before from the same inputs. Older provisioned images are removed (their systemd layers
    with them). Made under a lock: the container tier's two workers each ask for it, and the
    second, once the first has made it, reuses it."""
    (ROOT / ".cache").mkdir(exist_ok=True)
    with open(ROOT / ".cache" / "provisioned-image.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _provisioned_image()


def _provisioned_image():
    tag = provisioned_tag()
    log = ROOT / ".cache" / f"{tag.rsplit(':', 1)[1]}.log"
    if sh("podman", "image", "exists", tag, check=False).returncode == 0 and log.exists():
        print(f"reusing {tag}")
        return tag, log.read_text()
    down()
    builder = Cluster(up(1))
    r = builder.playbook("provision.yml")
    if r.returncode != 0:
        raise RuntimeError(f"provision.yml on the image's node failed:\n{r.output[-6000:]}")
    # The image's nodes boot with ufw not enabled, like a node the toolkit has not yet made part of
    # a cluster: the builder's rules (its own address and SSH port, default-deny) would shut out
    # the control node from a node with another port. The cluster's provision.yml enables ufw.
    # apt's downloaded packages (150 MB) are not kept in the image: nothing installs them again.
    sh("podman", "exec", PREFIX + builder.master, "sh", "-c",
       "sed -i s/^ENABLED=yes/ENABLED=no/ /etc/ufw/ufw.conf && apt-get clean")
    sh("podman", "commit", "-q", PREFIX + builder.master, tag)
    log.write_text(r.output)
    down()
    old = sh("podman", "images", "--format", "{{.Repository}}:{{.Tag}}", PROVISIONED_REPO).stdout.split()
    for other in [t for t in old if ":provisioned-" in t and t not in (tag, systemd_tag(tag))]:
        sh("podman", "rmi", "-f", other, check=False)
    return tag, r.output


def start_sshd(node):
    """Start a node's sshd again after a test stopped it."""
    h = next(h for h in json.loads((STATE / "cluster.json").read_text())["hosts"] if h["name"] == node)
    sh("podman", "exec", PREFIX + node, "/usr/sbin/sshd", "-p", str(h["port"]))
    wait_ssh([h])


def ssh_args(known_hosts=STATE / "known_hosts"):
    return ["-i", str(STATE / "id_ed25519"), "-o", f"UserKnownHostsFile={known_hosts}",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]


def wait_ssh(hosts, timeout=60, known_hosts=STATE / "known_hosts"):
    deadline = time.time() + timeout
    for h in hosts:
        while True:
            r = sh("ssh", *ssh_args(known_hosts), "-p", str(h["port"]), f"root@{h['ip']}", "true", check=False)
            if r.returncode == 0:
                break
            if time.time() > deadline:
                raise RuntimeError(f"ssh to {h['name']} ({h['ip']}:{h['port']}) failed: {r.stderr}")
            time.sleep(0.5)


def write_inventory(hosts, inv=STATE / "inventory", known_hosts=STATE / "known_hosts", extra=""):
    """The inventory of `hosts` (the cluster's, or another set of the test network's nodes, with
    their own known_hosts and `extra` group settings)."""
    (inv / "group_vars").mkdir(parents=True, exist_ok=True)
    lines = ["# Written by molecule/cluster.py for the test cluster.", "all:", "  children:",
             "    cluster:", "      hosts:"]
    for h in hosts:
        lines += [f"        {h['name']}:", f"          ansible_host: {h['ip']}",
                  f"          ansible_port: {h['port']}", "          dsc_slots: 1"]
    (inv / "hosts.yml").write_text("\n".join(lines) + "\n")
    (inv / "group_vars" / "all.yml").write_text(f"""---
ansible_user: root
ansible_ssh_private_key_file: {STATE / 'id_ed25519'}
ansible_ssh_common_args: -o UserKnownHostsFile={known_hosts}
dsc_cluster_name: testcluster
dsc_env_manager: venv
dsc_torch_variant: cpu
dsc_wheelhouse: {WHEELHOUSE}
# The vendored third-party scripts' packages (molecule/tests/test_own_scripts.py).
dsc_requirements_file: {ROOT / 'tests' / 'fixtures' / 'scripts' / 'requirements.txt'}
# A followed run's poll returns as soon as the run ends: a long interval costs no time, and spares
# the CPU a status through pdsh every few seconds. Tests that read the progress lines ask for 2 s.
follow_every_s: 30
""" + extra)


def lock_pins(text):
    """{name: version} of a hashed lock's lines (scripts/hashlock.py's format)."""
    return dict(line.split(" ")[0].split("==") for line in text.splitlines() if line and not line.startswith("#"))


def recap(output):
    """{host: {ok, changed, failed, ...}} from a PLAY RECAP."""
    out = {}
    for m in re.finditer(r"^(\S+)\s+:\s+(.*)$", output.split("PLAY RECAP")[-1], re.M):
        out[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return out


# Ansible's fact cache for this cluster's nodes (every cluster names its nodes node1, node2, ...).
FACTS = STATE / "facts"


class Cluster:
    """The running test cluster, as tests and benchmarks drive it."""

    def __init__(self, info, inventory=STATE / "inventory", known_hosts=STATE / "known_hosts"):
        """`info`'s hosts, reached through `inventory` (extra_nodes' for more nodes beside the
        cluster: its inventory and known_hosts)."""
        self.info = info
        self.inventory, self.known_hosts = inventory, known_hosts
        self.names = [h["name"] for h in info["hosts"]]
        self.master = self.names[0]

    def start_again(self, node):
        """A node stopped with podman stop started again, and the master reaching every other
        node over ssh as the training user again."""
        subprocess.run(["podman", "start", PREFIX + node], check=False, capture_output=True)
        host = next(h for h in self.info["hosts"] if h["name"] == node)
        wait_ssh([host], known_hosts=self.known_hosts)
        # The others' neighbour caches still hold the old interface's address: forgotten now, the
        # next packet asks again.
        for other in self.names:
            if other != node:
                self.exec(other, f"ip neigh flush to {host['ip']}", check=False)
        for other in self.names[1:]:
            wait(lambda o=other: self.exec(self.master, f"su dstrain -c 'ssh -o ConnectTimeout=3 {o} true'",
                                           check=False).returncode == 0, 120, f"ssh from the master to {other} again",
                 every=2)

    def playbook(self, name, *args, timeout=1800, env=None, inventory=None):
        """ansible-playbook with the project's ansible.cfg against the cluster's inventory (or
        another view of the same nodes); the result carries .recap ({host: counts}), .output and
        .seconds."""
        # dsc_timings: each task's time into $DSC_TIMINGS, where scripts/test.sh sets it. SSH's
        # persistent connections live with the cluster's state: none outlives its nodes into the
        # next cluster at the same addresses (the image's node, then the test cluster).
        env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_FORCE_COLOR="0",
                   ANSIBLE_CALLBACKS_ENABLED="dsc_timings", ANSIBLE_SSH_CONTROL_PATH_DIR=str(STATE / "cp"),
                   ANSIBLE_CACHE_PLUGIN_CONNECTION=str(FACTS),
                   PATH=f"{VENV_BIN}:{os.environ['PATH']}", **(env or {}))
        t0 = time.time()
        r = subprocess.run([str(VENV_BIN / "ansible-playbook"), "-i", str(inventory or self.inventory), name, *args],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        r.seconds = time.time() - t0
        r.recap = recap(r.stdout)
        r.output = r.stdout + r.stderr
        return r

    def exec(self, node, cmd, user=None, check=True, timeout=120):
        """A command inside a node's container (test inspection, not how the toolkit reaches nodes)."""
        inside = enter(PREFIX + node, user)
        if inside is None:  # as podman exec answers for a stopped container
            r = subprocess.CompletedProcess([node, cmd], 125, "", f"container {PREFIX + node} is not running")
        else:
            r = subprocess.run([*inside, "bash", "-lc", cmd], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=timeout)
        if check:
            assert r.returncode == 0, f"{node}: {cmd}: {r.stdout}{r.stderr}"
        return r

    def listen(self, node, port=29500, seconds=60):
        """A listener on a node's port over IPv4 and IPv6 (one dual-stack socket) for `seconds`;
        stop_listening ends it (it outlives its podman exec client)."""
        subprocess.Popen(["podman", "exec", PREFIX + node, "python3", "-c",
                          "import socket,time; s=socket.socket(socket.AF_INET6); "
                          "s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0); "
                          "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                          f"s.bind(('::', {int(port)})); s.listen(8); time.sleep({int(seconds)})"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait(lambda: f":{int(port)} " in self.exec(node, f"ss -Hltn 'sport = :{int(port)}'", check=False).stdout,
             10, f"the listener on {node}:{port}", every=0.2)

    def stop_listening(self, node, seconds=60):
        """Ends the node's listeners and waits until they are gone: a listen() right after must not
        take a dying listener's socket for its own."""
        pattern = f"'[t]ime.sleep.{int(seconds)}.'"
        self.exec(node, f"pkill -f {pattern} || true")
        wait(lambda: self.exec(node, f"pgrep -f {pattern}", check=False).returncode == 1,
             10, f"the listeners on {node} to end", every=0.1)

    def versions(self, node, python, names):
        """{distribution: installed version} in a node's env, read as the training user."""
        probe = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
        return json.loads(self.exec(node, f"{python} -c '{probe}' {' '.join(names)}", user="dstrain").stdout)

    def copy_to(self, node, src, dest):
        """A file from here into a node's container (test setup, not how the toolkit reaches nodes)."""
        subprocess.run(["podman", "cp", str(src), f"{PREFIX}{node}:{dest}"], check=True, capture_output=True,
                       env=dict(os.environ, CONTAINERS_CONF=os.environ["CONTAINERS_CONF"]))
        self.exec(node, f"chmod 0644 {dest}")

    def procs(self, node, run_id):
        """The run's processes on a node, as the node helper (run as the training user) sees them;
        None when the lookup itself fails."""
        r = self.exec(node, f"{HELPER} procs {run_id}", user="dstrain", check=False)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def rank_pids(self, node, run_id, program="--module train.run"):
        """The pids of a run's ranks on a node: `dsc_node.pyz entry <program>`, not the launcher."""
        return [p["pid"] for p in self.procs(node, run_id) or []
                if f"entry {program}" in p["cmd"] and "deepspeed.launcher" not in p["cmd"]]

    def complete_steps(self, node, run_id, root=RUNS):
        """The steps of a train.run run's complete checkpoints on a node."""
        r = self.exec(node, f"cd {root}/{run_id}/checkpoints 2>/dev/null && ls -d step*/COMPLETE "
                            "| sed 's/step//; s,/COMPLETE,,'", check=False)
        return {int(x) for x in r.stdout.split()}

    def wait_checkpoint(self, run_id, at_least, root=RUNS, timeout=300):
        """The newest step complete on every node, once it is at least `at_least` (train.run keeps
        only the newest keep_checkpoints: a given early step may be gone before a poll sees it)."""
        def common():
            steps = set.intersection(*(self.complete_steps(n, run_id, root) for n in self.names))
            return max(steps) if steps and max(steps) >= at_least else None
        return wait(common, timeout, f"a checkpoint of {run_id} at step {at_least} or later on every node", every=1)

    def run_status(self, run_id, root=RUNS):
        """The master's status of a run (the node helper's JSON)."""
        return json.loads(self.exec(self.master, f"{HELPER} status {root}/{run_id} {run_id}", user="dstrain").stdout)

    def host(self, node):
        import testinfra  # noqa: PLC0415 - the tests' alone: bench/ imports this module, never asks for a host
        return testinfra.get_host(f"ansible://{node}?ansible_inventory={self.inventory}")


def resumed_at_the_checkpoint_every_node_holds(cluster, run_id, code, nodes, inventory=None, mode=()):
    """A user's own DeepSpeed loop (tests/fixtures/checkpoint_loop.py, copied into `code`) run to
    step 8, saving at 4 and 8; global_step8 then lost on the last node (as a node lost mid-save
    leaves it), and the run resumed to step 12 with `--load {latest:ckpt/global_step*}`: every
    node loads global_step4, the newest every node holds, where each node alone would take its
    own newest. The nodes (`nodes`, the master first) start alone (`mode`: dsc_launch_mode no_ssh,
    or an inventory's slurm),
    so they agree on it before the start; each node's launcher log says so. -> those lines."""
    code.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "tests" / "fixtures" / "checkpoint_loop.py", code)
    args = ["-e", f"run_id={run_id}", "-e", "preflight=false", "-e", "follow=true", *mode]
    for n in nodes:
        cluster.exec(n, f"rm -rf {RUNS}/{run_id}")

    def loaded(node):
        return json.loads(cluster.exec(node, f"cat {RUNS}/{run_id}/code/loaded.json").stdout)
    r = cluster.playbook("launch.yml", *args, "-e", "preset=zero2", "-e", f"dsc_code_dir={code}",
                         "-e", "dsc_entry_script=checkpoint_loop.py", "-e", json.dumps(
        {"dsc_entry_args": ["--steps", "8", "--save-every", "4"],
         "dsc_resume_args": ["--load", "{latest:ckpt/global_step*}"]}), inventory=inventory)
    assert r.returncode == 0, r.output[-5000:]
    assert [loaded(n)["end"] for n in nodes] == [8] * len(nodes)
    cluster.exec(nodes[-1], f"rm -rf {RUNS}/{run_id}/code/ckpt/global_step8")
    r = cluster.playbook("resume.yml", *args, "-e", "force=true", "-e", json.dumps(
        {"dsc_entry_args": ["--steps", "12", "--save-every", "4"]}), inventory=inventory)
    assert r.returncode == 0, r.output[-5000:]
    said = []
    for n in nodes:
        log = cluster.exec(n, f"cat {RUNS}/{run_id}/launcher.log").stdout
        line = next((x for x in log.splitlines() if x.startswith("[dsc_node] {latest:ckpt/global_step*}")), "")
        assert {k: loaded(n)[k] for k in ("loaded_step", "end")} == {"loaded_step": 4, "end": 12}, (
            loaded(n), line, log[-2000:], r.output[-4000:])
        assert line.startswith("[dsc_node] {latest:ckpt/global_step*}: ckpt/global_step4, the newest complete on "), log[-3000:]
        assert line.endswith(f"; passed over: ckpt/global_step8 ({nodes[-1]}: not there) (agreed before the start)"), line
        assert "--load ckpt/global_step4" in log, log[-3000:]
        said.append(f"{n}: {line}")
    return said


def wait(cond, timeout, what, every=1.0):
    """cond()'s first truthy value, polled every `every` s, or an AssertionError naming `what`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["up", "down", "env", "image", "systemd-layer"])
    p.add_argument("--nodes", type=int, default=int(os.environ.get("DSC_TEST_NODES", "2")))
    a = p.parse_args(argv)
    if a.action == "up":
        up(a.nodes)
        print(STATE / "inventory")
    elif a.action == "down":
        down()
    elif a.action == "image":
        print(provisioned_image()[0])
    elif a.action == "systemd-layer":
        print(systemd_image(provisioned_tag()))
    else:
        print(STATE / "inventory")


if __name__ == "__main__":
    sys.exit(main())
