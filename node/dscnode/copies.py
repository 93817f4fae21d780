"""Node-local checkpoints that survive a lost node: after each save, every node's part is also kept
on the next node of the run (the last node's on the master), a ring, so any one node lost or
wiped leaves each part on a node still there. Only the master holds the cluster's ssh key, so its
supervisor relays each part: `send` on the node that holds it, piped through ssh into `receive` on
the node that keeps it, both as the training user, at low priority, while the run trains on.

The entry shim records each save of a node-local checkpoint in the run directory (SAVES, global
rank 0); the supervisor copies it once the run has logged a later step, or has ended, so a part is
copied after the script has finished writing it (train.run's COMPLETE, HF's trainer_state.json).
A copy lives in the checkpoint's own tag folder, `<tag>/.dsc_parts/<node>/`: a retention that
removes the checkpoint removes its copies with it, and DeepSpeed's loaders, which read their own
file names in the tag folder, never see it.

Before every attempt (a launch, a resume, a restart) the supervisor puts back, from its copy, the
part of any node that lacks a checkpoint every other node holds complete (a node whose disk was
replaced or wiped), so the run resumes from that checkpoint instead of an older one or none.

Where checkpoints go to a directory every node mounts (dsc_checkpoint_shared_dir) nothing is
copied; shared_dir is the check, before every start, that it is one directory across the nodes."""
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time

from dscnode import complete, program
from dscnode.procs import on_others
from dscnode.rundir import RunDir, append_line, last_lines, write_atomic
from dscnode.safe import SHELL_SAFE

PARTS = ".dsc_parts"  # in a tag folder: the copies of other nodes' parts, a folder each
NICE = 10  # the copy's processes yield the CPU to the ranks
NAME = re.compile(r"[\w@%+=:,.-]+")  # a tag or a node: one path component, unquoted on a command line
TIMEOUT_S = 3600.0  # one part's copy


def refuse(what, value):
    raise SystemExit(f"dsc_node: {what} {value!r} is refused: it must be an absolute path (or a single name) "
                     "of letters, digits and @%+=:,._- alone")


def checked(save_dir, tag=None, node=None):
    """The tag folder (without a tag, the save directory), where the save directory is absolute
    without `..` and the tag and the node single names a command line takes unquoted; SystemExit
    otherwise."""
    if not (save_dir.startswith("/") and SHELL_SAFE.fullmatch(save_dir)
            and ".." not in save_dir.split("/")):
        refuse("the save directory", save_dir)
    for what, value in (("the tag", tag), ("the node", node)):
        if value is not None and (not NAME.fullmatch(value) or value in (".", "..")):
            refuse(what, value)
    return os.path.join(save_dir, tag) if tag else save_dir


def ring(hosts):
    """{node: the node that keeps a copy of its part}: the next node, the last's the first."""
    hosts = list(hosts)
    return {h: hosts[(i + 1) % len(hosts)] for i, h in enumerate(hosts)} if len(hosts) > 1 else {}


def part_files(folder):
    """The regular files of a part under `folder` (relative paths; links and the copies of other
    nodes' parts left out), with markers (train.run's COMPLETE) last: a part received whole."""
    out = []
    for root, dirs, files in os.walk(folder):
        if root == folder:
            dirs[:] = [d for d in dirs if d != PARTS]
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                out.append(os.path.relpath(path, folder))
    return sorted(out, key=lambda p: (p == RunDir.COMPLETE, p))


def send(save_dir, tag, copy_of=None, out=None):
    """Write this node's part of the checkpoint (or, with copy_of, the copy it keeps of that node's
    part) to `out` as a tar stream. A part not marked complete here is not sent."""
    folder = checked(save_dir, tag, copy_of)
    if copy_of:
        folder = os.path.join(folder, PARTS, copy_of)
    elif tag not in (complete.tags(save_dir) or []):
        raise SystemExit(f"dsc_node: {folder} is not marked complete on this node")
    send_folder(folder, out)


def send_folder(folder, out=None):
    """The regular files of `folder` (part_files) to `out` as a tar stream, at low priority."""
    if not os.path.isdir(folder) or os.path.islink(folder):
        raise SystemExit(f"dsc_node: no part at {folder} on this node")
    os.nice(NICE)
    out = out or sys.stdout.buffer
    with tarfile.open(fileobj=out, mode="w|") as tar:
        for rel in part_files(folder):
            path = os.path.join(folder, rel)
            with open(path, "rb") as f:
                info = tar.gettarinfo(fileobj=f, arcname=rel)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, f)
    out.flush()


def safe_member(member):
    """Whether a received member is a regular file or folder with a relative name inside its part."""
    name = posixpath.normpath(member.name)
    return ((member.isfile() or member.isdir()) and not name.startswith(("/", "../")) and name != ".."
            and PARTS not in name.split("/"))


def unpack(inp, into):
    """The tar stream's regular files and folders into the new folder `into`: (files, bytes)."""
    os.makedirs(into, mode=0o750)
    files = size = 0
    with tarfile.open(fileobj=inp, mode="r|") as tar:
        for member in tar:
            if not safe_member(member):
                raise SystemExit(f"dsc_node: {member.name!r} in a checkpoint part is refused (not a "
                                 "regular file inside its part)")
            path = os.path.join(into, posixpath.normpath(member.name))
            if member.isdir():
                os.makedirs(path, mode=0o750, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
            with tar.extractfile(member) as src, open(path, "xb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.utime(path, (member.mtime, member.mtime))
            files, size = files + 1, size + member.size
    return files, size


def receive(save_dir, tag, from_node=None, inp=None):
    """Keep the part arriving on `inp` (a tar stream from `send`): with from_node, as this node's
    copy of that node's part (replacing an older copy of it); without, as this node's own part
    (put back from its copy), marked complete once whole. Prints {files, bytes}."""
    folder = checked(save_dir, tag, from_node)
    os.nice(NICE)
    inp = inp or sys.stdin.buffer
    if from_node:
        if not os.path.isdir(folder):
            raise SystemExit(f"dsc_node: no checkpoint {folder} on this node to keep {from_node}'s part beside")
        keep = os.path.join(folder, PARTS, from_node)
        tmp = os.path.join(folder, PARTS, f".{from_node}.{os.getpid()}")
        try:
            files, size = unpack(inp, tmp)
            shutil.rmtree(keep, ignore_errors=True)
            os.rename(tmp, keep)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                os.rmdir(os.path.dirname(keep))  # where no copy is kept, no folder for them either
            except OSError:
                pass
    else:
        tmp = os.path.join(save_dir, f".{tag}.restore.{os.getpid()}")
        os.makedirs(save_dir, mode=0o750, exist_ok=True)
        try:
            files, size = unpack(inp, tmp)
            os.makedirs(folder, mode=0o750, exist_ok=True)
            for rel in part_files(tmp):  # markers last
                os.makedirs(os.path.dirname(os.path.join(folder, rel)), mode=0o750, exist_ok=True)
                os.replace(os.path.join(tmp, rel), os.path.join(folder, rel))
            complete.mark(save_dir, tag)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"files": files, "bytes": size}), flush=True)


def held(save_dir):
    """What this node holds of the save directory's checkpoints: the tags marked complete (oldest
    first) and, by tag, the nodes whose parts it keeps copies of."""
    tags = complete.tags(save_dir) or []
    copies = {}
    for tag in tags:
        try:
            copies[tag] = sorted(e.name for e in os.scandir(os.path.join(save_dir, tag, PARTS))
                                 if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))
        except OSError:
            pass
    return {"tags": tags, "copies": copies}


def survey(hosts, save_dir):
    """{node: what it holds of the save directory (held)} for this node (hosts[0]) and every other
    that answers; a node missing from it did not answer."""
    held_by = {hosts[0]: held(save_dir)}
    for host, said in on_others(hosts, "part-held", save_dir).items():
        try:
            held_by[host] = json.loads(said)
        except ValueError:
            pass
    return held_by


def helper(host, here, *args):
    """The node helper with args on `host`: this process's own where host is `here`, else through
    ssh as the training user (the cluster key's ssh config names each node's port)."""
    argv = [program(), *map(str, args)]  # which lowers its own priority
    # A node gone (stopped, unplugged) fails the copy in seconds, not at TCP's own timeouts.
    return argv if host == here else ["nice", "-n", str(NICE), "ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
                                      "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4", host, shlex.join(argv)]


def relay(sender, receiver, timeout=TIMEOUT_S):
    """Pipe `sender`'s output into `receiver`: (what receiver printed as JSON, or None, and the
    first error line)."""
    src = subprocess.Popen(sender, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    dst = subprocess.Popen(receiver, stdin=src.stdout, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    src.stdout.close()
    try:
        out, err = dst.communicate(timeout=timeout)
        src_err = src.communicate(timeout=10)[1]
    except subprocess.TimeoutExpired:
        src.kill()
        dst.kill()
        src.communicate()
        dst.communicate()
        return None, f"not done within {timeout:.0f} s"
    try:
        return json.loads(out.decode().strip().splitlines()[-1]), ""
    except (ValueError, IndexError):
        said = (src_err if src.returncode else err).decode(errors="replace").strip().splitlines()  # the sender's first
        return None, (said[-1] if said else f"exit codes {src.returncode}, {dst.returncode}")[:300]


def keep_copies(save, hosts, record):
    """Copy every node's part of the save (a SAVES line) to the next node; the outcome appended to
    `record` (COPIES) and said in the launcher log."""
    here, started = hosts[0], time.time()
    kept, failed, size = [], [], 0
    for node, keeper in ring(hosts).items():
        got, error = relay(helper(node, here, "part-send", save["save_dir"], save["tag"]),
                           helper(keeper, here, "part-receive", save["save_dir"], save["tag"], "--from", node))
        if got:
            kept.append(f"{node}'s on {keeper}")
            size += got["bytes"]
        else:
            failed.append(f"{node}'s to {keeper}: {error}")
    took = time.time() - started
    append_line(record, json.dumps({"tag": save["tag"], "save_dir": save["save_dir"], "kept": kept,
                                    "failed": failed, "bytes": size, "seconds": round(took, 2),
                                    "time": round(time.time(), 1)}))
    print(f"[dsc_node] checkpoint {save['tag']}: each node's part also kept on the next node "
          f"({', '.join(kept) or 'none'}; {size / 1e6:.1f} MB in {took:.1f} s)"
          + (f"; not kept: {'; '.join(failed)}" if failed else ""), flush=True)


def saves(run):
    """The run's recorded saves (SAVES), oldest first: the lines that name a save directory and a tag."""
    return [s for s in last_lines(run / RunDir.SAVES, 1000)
            if isinstance(s.get("save_dir"), str) and isinstance(s.get("tag"), str)]


def shared_save(save):
    """A save to a shared directory (dsc_checkpoint_shared_dir): one copy that every node reads,
    nothing to keep elsewhere (saves recorded before the flag were all node-local)."""
    return save.get("node_local") is False


SHARED_MARK = ".dsc_shared_"  # + a token: the master's mark in dsc_checkpoint_shared_dir
TOKEN = re.compile(r"[0-9a-f]{32}")


def shared_dir(folder, mark=False, seen="", unmark="", wait_s=10.0):
    """dsc_checkpoint_shared_dir, checked before a start: `mark` writes a file of a new token in it
    (created where missing; the master's), `seen` says whether a node finds that file there (for
    up to wait_s: a network filesystem may show it late), `unmark` removes it. {token} or {seen}."""
    folder = checked(folder)
    if os.path.islink(folder):
        refuse("the shared checkpoint directory (a link)", folder)
    if mark:
        import secrets  # noqa: PLC0415 - this action alone
        os.makedirs(folder, mode=0o750, exist_ok=True)
        token = secrets.token_hex(16)
        write_atomic(os.path.join(folder, SHARED_MARK + token), token + "\n")
        return {"token": token}
    token = seen or unmark
    if not TOKEN.fullmatch(token):
        refuse("the mark", token)
    path = os.path.join(folder, SHARED_MARK + token)
    if unmark:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return {"removed": True}
    deadline = time.time() + wait_s
    while not os.path.isfile(path) and time.time() < deadline:
        time.sleep(0.5)
    return {"seen": os.path.isfile(path)}


def node_local_saves(run):
    """The recorded saves each node holds a part of."""
    return [s for s in saves(run) if not shared_save(s)]


class Copier:
    """The supervisor's copies of the run's saves: the newest save recorded (SAVES) not yet copied
    is copied in a thread of its own, one at a time, copying at most DUTY of the time (a save
    recorded meanwhile waits, an older waiting one is skipped; the run's last is always copied)."""

    DUTY = 0.1  # after a copy that took t seconds, the next starts t / DUTY after it started

    def __init__(self, run, hosts, enabled=True, logged_step=lambda: None):
        self.run, self.hosts, self.logged_step = run, list(hosts), logged_step  # the run's latest logged step
        self.enabled = enabled and len(self.hosts) > 1
        self.seen = {json.dumps(s, sort_keys=True) for s in self.saves()}  # copied, or before this supervisor
        self.waiting, self.thread, self.next_at = None, None, 0.0

    def saves(self):
        return node_local_saves(self.run)

    def poll(self, ended=False):
        """Take the newest save recorded; copy the one waiting where no copy runs, the run has
        moved on from it (a later step logged) and the pace allows, or, `ended`, at once."""
        if not self.enabled:
            return
        for save in self.saves():
            key = json.dumps(save, sort_keys=True)
            if key not in self.seen:
                self.seen.add(key)
                self.waiting = save
        if not self.waiting or (self.thread and self.thread.is_alive()):
            return
        step = self.logged_step()
        moved_on = isinstance(step, int) and step > self.waiting.get("step", 0)
        if ended or (moved_on and time.time() >= self.next_at):
            save, self.waiting = self.waiting, None
            self.thread = threading.Thread(target=self.copy, args=(save,), daemon=True)
            self.thread.start()

    def copy(self, save):
        started = time.time()
        try:
            checked(save["save_dir"], save["tag"])
            keep_copies(save, self.hosts, self.run / RunDir.COPIES)
        except (SystemExit, Exception) as e:  # noqa: BLE001 - a copy lost is said, the run goes on
            print(f"[dsc_node] checkpoint {save.get('tag')}: not copied: {e}", flush=True)
        self.next_at = started + (time.time() - started) / self.DUTY

    def finish(self, timeout=TIMEOUT_S):
        """Copy what is still waiting (the attempt's last save) once its processes have ended,
        before a restart or the run's end is recorded."""
        deadline = time.time() + timeout
        while self.enabled and time.time() < deadline:
            self.poll(ended=True)
            if not self.waiting and not (self.thread and self.thread.is_alive()):
                return
            time.sleep(0.5)


def restore(run, hosts):
    """Before an attempt: put back, from its copy, each node's part of the newest checkpoint of the
    run's newest save directory that every other node holds complete, where that node lacks it.
    The lines said in the launcher log."""
    hosts = list(hosts)
    recorded = saves(run)
    if len(hosts) < 2 or not recorded or shared_save(recorded[-1]):
        return
    save_dir = recorded[-1]["save_dir"]
    try:
        checked(save_dir)
    except SystemExit:
        return
    held_by = survey(hosts, save_dir)
    if len(held_by) < len(hosts):
        return  # a node that does not answer: the attempt itself says so
    keeper = ring(hosts)
    newest_first = dict.fromkeys(t for h in hosts for t in reversed(held_by[h]["tags"]))
    for tag in newest_first:
        lacking = [h for h in hosts if tag not in held_by[h]["tags"]]
        if not lacking:
            return  # complete on every node: nothing older is needed
        node = lacking[0]
        if len(lacking) > 1 or node not in held_by[keeper[node]]["copies"].get(tag, []):
            continue  # lost on more than one node, or no copy of it: an older checkpoint may do
        got, error = relay(helper(keeper[node], hosts[0], "part-send", save_dir, tag, "--copy-of", node),
                           helper(node, hosts[0], "part-receive", save_dir, tag))
        print(f"[dsc_node] checkpoint {tag}: {node}'s part put back from its copy on {keeper[node]}"
              + (f" ({got['files']} files, {got['bytes'] / 1e6:.1f} MB)" if got else f" failed: {error}"),
              flush=True)
        if got:
            return
