"""Checkpoints complete across the cluster, for scripts that save and load through DeepSpeed's
engine (engine.save_checkpoint / load_checkpoint, as DeepSpeed-style loops, HF's Trainer and
accelerate do). The entry shim marks a tag complete on a node once DeepSpeed's save has returned
there: the save ends at a barrier, so every rank's part is written by then, on every node. A load
without a tag then takes the newest tag marked on every node, which every rank agrees on, instead
of each node's own `latest` (written before that barrier on global rank 0's node, so it can name a
checkpoint another node cut short).

The marks are `complete_tags` in the save directory, a tag a line in the order saved: on every
node where checkpoints are node-local (checkpoint.use_node_local_storage), on global rank 0's
where they are shared. Read by the training user who wrote them, from its tail (TAIL_BYTES)."""
import os

from dscnode.rundir import append_line, read_tail

MARKS = "complete_tags"
TAIL_BYTES = 64 << 10  # the newest ~3,000 tags


def mark(save_dir, tag):
    """Tag `tag` complete in `save_dir` on this node."""
    append_line(os.path.join(save_dir, MARKS), str(tag))


def tags(load_dir):
    """The tags marked complete here whose folder is still there, oldest first; None where
    nothing was ever marked (checkpoints saved without the shim)."""
    try:
        text, offset = read_tail(os.path.join(load_dir, MARKS), TAIL_BYTES)
    except OSError:
        return None
    lines = text.decode(errors="replace").splitlines()[1 if offset else 0:]  # a cut first line is no tag
    newest_last = list(dict.fromkeys(t.strip() for t in reversed(lines)))[::-1]  # a tag saved again counts then
    return [t for t in newest_last if t and os.path.isdir(os.path.join(load_dir, t))]


def agreed(everyone):
    """The newest tag complete on every node, from each rank's `tags` (all gathered): "" where
    marks exist but no tag is complete everywhere, None where no node has marks (DeepSpeed's own
    `latest` then decides, as before)."""
    marked = [t for t in everyone if t is not None]
    if not marked:
        return None
    common = [t for t in marked[0] if all(t in other for other in marked[1:])]
    return max(common, key=marked[0].index) if common else ""
