"""dsc_min_nodes: what a run may go on with when it loses nodes, decided at launch. For each world
size of at least dsc_min_nodes nodes, the batch that keeps the global batch (or the nearest, and
why) and that world size's ds_config, in the run directory on every node; the master's supervisor
takes them where the run goes on on other nodes (dscnode.shrink)."""
from __future__ import annotations

import json

from dscnode.rundir import RunDir

from .problems import as_bool, is_int
from .record import runs_seen


def shrunk_batch(total, micro, world):
    """The batch of a run gone on at `world` ranks (dsc_min_nodes): the same global batch `total`
    where it can be, by more gradient accumulation at the same micro-batch, else at the largest
    micro-batch below it that divides the samples each rank now takes (never a larger one: it
    would need memory the run never measured); where `total` is no multiple of `world`, the
    nearest global batch at the same micro-batch, and why. {micro_batch, grad_accum,
    train_batch, exact, why}."""
    per_rank, rem = divmod(total, world)
    if not rem:
        fits = max(m for m in range(1, min(micro, per_rank) + 1) if not per_rank % m)
        return {"micro_batch": fits, "grad_accum": per_rank // fits, "train_batch": total, "exact": True,
                "why": "" if fits == micro else f"micro-batch {fits}: {micro} does not divide the "
                                                f"{per_rank} samples each of {world} ranks takes"}
    accum = max(1, round(total / (micro * world)))
    return {"micro_batch": micro, "grad_accum": accum, "train_batch": micro * accum * world, "exact": False,
            "why": f"global batch {micro * accum * world}, not {total}: {total} samples do not split "
                   f"evenly over {world} ranks"}


def shrink_files(opt, plan, launcher, config, step_down, problems):
    """dsc_min_nodes: shrink.json (the launch's nodes and their ranks, and for each world size the
    run may go on at, its batch: shrunk_batch) and each smaller world size's ds_config, written
    once, at launch; {} where it is 0. Refused where the
    run could not go on: a launch mode whose supervisor does not reach every node, no restarts to
    go on with, no copies of the lost node's checkpoint part, a batch the toolkit does not set, or
    preset=auto's step-down ladder (its steps are each one ds_config of the full cluster)."""
    value, nodes = opt["dsc_min_nodes"], plan.nodes
    if not is_int(value) or not 0 <= int(value) <= len(nodes):
        problems.add(f"dsc_min_nodes is {value!r}. Fix: the fewest nodes the run may go on with, "
                     f"1 to {len(nodes)} (the inventory's nodes), or 0 to fail the run as before.")
        return {}
    least = int(value)
    if not least or least == len(nodes):
        return {}
    why = []
    if launcher.shrink_why():
        why.append(launcher.shrink_why())
    if not is_int(opt["max_restarts"]) or int(opt["max_restarts"]) < 1:
        why.append("max_restarts is 0: a run goes on on fewer nodes at a restart. Fix: -e max_restarts=2 (or more)")
    if not as_bool(opt["dsc_checkpoint_copies"]) and not opt["dsc_checkpoint_shared_dir"]:
        why.append("dsc_checkpoint_copies is false: a lost node's part of each checkpoint would go with it. "
                   "Fix: dsc_checkpoint_copies=true, or dsc_checkpoint_shared_dir where the nodes share a filesystem")
    sizes = (config or {}).get("train_batch_size"), (config or {}).get("train_micro_batch_size_per_gpu")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
        why.append("the run's DeepSpeed config sets no whole train_batch_size and micro-batch (a config the "
                   "script or its trainer completes): the global batch could not be kept. Fix: a preset, or "
                   "dsc_ds_config_mode file with both numbers in it")
    if step_down:
        why.append("preset=auto's step-down ladder is one ds_config per step for the whole cluster. Fix: "
                   "the preset auto chose (its line in launch.yml's output)")
    if why:
        problems.add(f"dsc_min_nodes={least}: " + "; ".join(why) + ".")
        return {}
    total, micro = sizes
    full = sum(n.slots for n in nodes)  # the launch's own, taken again where every node is back
    worlds = {full: dict(micro_batch=micro, grad_accum=config.get("gradient_accumulation_steps"), train_batch=total,
                         exact=True, why="", config=RunDir.DS_CONFIG)}
    for world in smaller_worlds([n.slots for n in nodes], least):
        worlds[world] = dict(shrunk_batch(total, micro, world), config=RunDir.world_config(world))
    files = {RunDir.SHRINK: json.dumps({"min_nodes": least, "nodes": [n.name for n in nodes],
                                        "slots": {n.name: n.slots for n in nodes},
                                        "worlds": {str(w): b for w, b in sorted(worlds.items())}},
                                       indent=2, sort_keys=True) + "\n"}
    for sizes in worlds.values():
        if sizes["config"] != RunDir.DS_CONFIG:
            files[sizes["config"]] = json.dumps(
                dict(config, train_batch_size=sizes["train_batch"], train_micro_batch_size_per_gpu=sizes["micro_batch"],
                     gradient_accumulation_steps=sizes["grad_accum"]), indent=2, sort_keys=True) + "\n"
    return files


def smaller_worlds(slots, least):
    """The world sizes of `least` or more of the nodes (their ranks: `slots`), but not all of
    them: any may be lost, the master too (a resume then goes on with the next node as master).
    Counted as (nodes, ranks) pairs one node at a time, so that many nodes cost no combinations."""
    reached = {(0, 0)}
    for ranks in slots:
        reached |= {(count + 1, world + ranks) for count, world in reached}
    return sorted({world for count, world in reached if least <= count < len(slots)} - {sum(slots)})


def resume_without(names, lost, probes, options):
    """resume.yml where nodes do not answer (`lost`, of the inventory's `names`): (the nodes to
    resume the run on, in the inventory's order, the first of them its master now; a note saying
    so) where the run was launched with dsc_min_nodes and that many answer; else (None, why it
    cannot go on without them, or "" where it is no such resume). The run and its launch spec are
    read from the first node that answers (every node holds the run's files); the master's
    supervisor then converts the newest checkpoint for those nodes (dscnode.shrink.regroup)."""
    left = [n for n in names if n not in lost]
    if not (lost and left and as_bool(options.get("resume"))):
        return None, ""
    seen = runs_seen(probes.get(left[0]))
    run_id = str(options.get("run_id") or "") or (seen[0].id if seen else "")
    least = next((r.launch or {} for r in seen if r.id == run_id), {}).get("dsc_min_nodes")
    if not is_int(least) or int(least) < 1:
        return None, ""
    least = int(least)
    if len(left) < least:
        return None, (f"run {run_id} goes on with at least {least} node(s) (its dsc_min_nodes), and "
                      f"{len(left)} answer: {', '.join(left)}. Fix: bring a node back first.")
    return left, (f"{', '.join(lost)} {'does' if len(lost) == 1 else 'do'} not answer: run {run_id} "
                  f"resumes on {', '.join(left)}, {left[0]} its master (its dsc_min_nodes is "
                  f"{least}), from its newest checkpoint converted for them.")
