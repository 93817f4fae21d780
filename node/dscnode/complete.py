"""Checkpoints complete across the cluster, for scripts that save and load through DeepSpeed's
engine (engine.save_checkpoint / load_checkpoint, as DeepSpeed-style loops, HF's Trainer and
accelerate do). The entry shim marks a tag complete on a node once DeepSpeed's save has returned
there: the save ends at a barrier, so every rank's part is written by then, on every node. A load
without a tag then takes the newest tag marked on every node, which every rank agrees on, instead
of each node's own `latest` (written before that barrier on global rank 0's node, so it can name a
checkpoint another node cut short).

The marks are `complete_tags` in the save directory, a tag a line in the order saved: on every
node where checkpoints are node-local (checkpoint.use_node_local_storage), on global rank 0's
where they are shared. Read by the training user who wrote them, from its tail (TAIL_BYTES).

A script resumed with `{latest:GLOB}` (HF's --resume_from_checkpoint out/checkpoint-*) gets the
newest match complete on every node the supervisor reaches (newest_everywhere). What a finished
save holds is read from the saves themselves, so a save cut short on every node at once is passed
over too: the shim's mark once any match anywhere is marked, and HF's trainer_state.json (the
Trainer writes it last) in a folder the Trainer wrote its training_args.bin into, or once any
match anywhere holds one."""
import os
import re

from dscnode.rundir import append_line, read_tail

MARKS = "complete_tags"
# In a tag folder: a universal checkpoint (dscnode.shrink's, for another world size), which the entry
# shim loads with DeepSpeed's load_universal; its text says what it was converted from.
UNIVERSAL = "dsc_universal"
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


# HF's Trainer: the first file it writes into its checkpoint-N (with the model) and the last
TRAINER_ARGS, TRAINER_STATE = "training_args.bin", "trainer_state.json"


def match_state(path):
    """What a `{latest:GLOB}` match holds on this node of a finished save: marked (True: a tag
    marked complete there, False: marks but none whose folder is left, None: no marks), and
    whether HF's Trainer began (trainer) and finished (trainer_state) its part."""
    t = tags(path)
    return {"marked": None if t is None else bool(t),
            "trainer": os.path.isfile(os.path.join(path, TRAINER_ARGS)),
            "trainer_state": os.path.isfile(os.path.join(path, TRAINER_STATE))}


def step_of(match):
    """The last number in a match's name (checkpoint-40: 40, global_step8: 8), -1 where none."""
    nums = re.findall(r"\d+", os.path.basename(match.rstrip("/")))
    return int(nums[-1]) if nums else -1


def newest_everywhere(states, nodes):
    """The newest match complete on every node, and why each newer one was passed over:
    (match or None, ["out/checkpoint-120 (node2: no trainer_state.json)", ...]). `states` holds
    each node's {match: match_state}, newest first, in `nodes`' order; the candidates are every
    node's matches, newest first by the last number in the name (the first node's order where
    that ties), so a match a node lacks is said whichever node comes first."""
    every = [s for node in states for s in node.values()]
    marks_used = any(s["marked"] for s in every)
    trainer_state_used = any(s["trainer_state"] for s in every)

    def lacks(state):
        if state is None:
            return "not there"
        if state["marked"] is False or (marks_used and not state["marked"]):
            return "DeepSpeed's part not marked complete"
        if (state["trainer"] or trainer_state_used) and not state["trainer_state"]:
            return f"no {TRAINER_STATE}"
        return None

    candidates = sorted(dict.fromkeys(m for node in states for m in node), key=step_of, reverse=True)
    passed = []
    for match in candidates:
        gaps = [f"{node}: {why}" for node, node_states in zip(nodes, states, strict=True) if (why := lacks(node_states.get(match)))]
        if not gaps:
            return match, passed
        passed.append(f"{match} ({'; '.join(gaps)})")
    return None, passed
