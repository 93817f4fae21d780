"""Checkpoint housekeeping that needs no torch: which checkpoint is the latest complete one, which
to prune, how much space the next one needs, and getting a written one onto stable storage.

run.py calls these around DeepSpeed's save_checkpoint; tests/unit tests them without torch
(standard library only, and the run directory's names from dscnode.rundir).
"""
from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from dscnode.rundir import RunDir

COMPLETE = RunDir.COMPLETE
TAG = re.compile(r"step(0|[1-9][0-9]*)")
# Bytes per parameter of a checkpoint when none is on disk yet to measure: the ZeRO paper's figure
# for mixed-precision Adam (fp16/bf16 weights 2 + fp32 master weights 4 + Adam's two fp32 moments
# 8, rounded up to 16), which also covers fp32 training (weights 4 + moments 8). Conservative
# where ZeRO shards optimizer states over node-local disks: each node then holds less.
BYTES_PER_PARAM = 16
MARGIN = 0.10


def scan(ckpt_dir) -> list[tuple[int, bool]]:
    """(step, complete) for each step<N> directory in ckpt_dir; other names are not checkpoints."""
    try:
        entries = list(os.scandir(ckpt_dir))
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        m = TAG.fullmatch(e.name)
        if m and e.is_dir(follow_symlinks=False):
            out.append((int(m.group(1)), os.path.exists(os.path.join(e.path, COMPLETE))))
    return sorted(out)


def latest_complete(ckpt_dir: Path):
    """The newest checkpoint tag with its COMPLETE marker; a half-written one is never taken."""
    steps = [step for step, complete in scan(ckpt_dir) if complete]
    return Path(ckpt_dir) / f"step{max(steps)}" if steps else None


def to_prune(checkpoints, keep: int, saved: int) -> list[str]:
    """The tags to remove once checkpoint `saved` is complete, from (step, complete) pairs:
    complete ones older than the newest `keep` (`saved` counting as one of them), and incomplete
    ones older than `saved` (the remains of an interrupted write, never resumed from).

    `saved` and anything newer stay: a newer one belongs to an earlier attempt (complete on only
    some nodes, or a run started over in the same directory), and the run overwrites it when it
    gets there.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    kept = sorted((step for step, complete in checkpoints if complete and step < saved),
                  reverse=True)[:keep - 1]
    return [f"step{step}" for step, _ in sorted(checkpoints) if step < saved and step not in kept]


def remove(path) -> None:
    """Delete a checkpoint directory, its COMPLETE marker first: a removal cut short leaves an
    incomplete checkpoint (skipped by resume, pruned next time), never a complete-looking partial
    one. Entries already gone are fine: on a shared filesystem every node prunes the same
    directory."""
    path = Path(path)
    (path / COMPLETE).unlink(missing_ok=True)
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            try:
                os.unlink(os.path.join(root, name))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(root)
        except FileNotFoundError:
            pass


def prune(ckpt_dir, keep: int, saved: int):
    """Apply to_prune to ckpt_dir: (the tags removed, [(tag, error)] for those that could not be).
    A failed removal is reported, not raised: the run goes on, and the free-space check before the
    next save stops it if the disk does fill."""
    removed, failed = [], []
    for tag in to_prune(scan(ckpt_dir), keep, saved):
        try:
            remove(Path(ckpt_dir) / tag)
            removed.append(tag)
        except OSError as e:
            failed.append((tag, e))
    return removed, failed


def tree_size(path) -> int:
    """Bytes in the regular files under path (symlinks not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def needed_bytes(previous: int | None, params: int) -> int:
    """Bytes the next checkpoint needs on this node: the size of the newest complete one when
    there is one (the next is the same size), else params x BYTES_PER_PARAM; plus MARGIN. Only
    one checkpoint's worth: older ones are pruned after the new one is complete."""
    return int((previous or params * BYTES_PER_PARAM) * (1 + MARGIN))


def gib(n: int) -> str:
    g = n / 2**30
    return f"{g:.1f} GiB" if g >= 1 else f"{g:.2g} GiB"


def space_problem(tag: str, path, node: str, free: int, needed: int, keep: int) -> str | None:
    """The error for a node without room for the next checkpoint, or None. One line: the node
    helper's status shows a rank's exception line as the run's first error."""
    if free >= needed:
        return None
    return (f"checkpoint {tag} needs {gib(needed)} at {path} on {node}, {gib(free)} free. "
            f"Fix: free space there (resume needs only the newest complete checkpoint), lower "
            f"keep_checkpoints (now {keep}), or put checkpoint_dir or the run root on a bigger disk")


def fsync_path(path, directory: bool = False) -> None:
    """fsync one file or directory. A filesystem that cannot fsync a directory (EINVAL or
    ENOTSUP, as some FUSE and network filesystems answer) orders its metadata its own way."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if not (directory and e.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise
    finally:
        os.close(fd)


def fsync_tree(path) -> None:
    """fsync every regular file under path, then every directory bottom-up, path itself last:
    the checkpoint's data and its directory entries are on stable storage before it is marked
    complete."""
    for root, _, files in os.walk(path, topdown=False):
        for name in files:
            file = os.path.join(root, name)
            if not os.path.islink(file):
                fsync_path(file)
        fsync_path(root, directory=True)


def mark_complete(tag_dir, text: str, node: str) -> None:
    """Write tag_dir/COMPLETE atomically and durably: a temporary file, fsynced, renamed into
    place, then the directory fsynced so that the rename itself survives a crash."""
    tag_dir = Path(tag_dir)
    tmp = tag_dir / f"{COMPLETE}.{node}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, tag_dir / COMPLETE)
    fsync_path(tag_dir, directory=True)
