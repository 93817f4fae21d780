"""doctor.yml's verdicts: every pair of nodes measured (iperf3 and a two-rank all-reduce, in rounds
of disjoint pairs), each pair against the cluster, and the outliers named.

    {{ names | dsc_pair_rounds }}                               -> [[[a, b], ...] per round] (names)
    {{ (names, sent, allreduce, error) | dsc_doctor_report }}   -> {pairs, findings, median}
    {{ report | dsc_doctor_table }}                             -> lines: a row per pair, then findings

Each figure is shown against the cluster's median: the median over the nodes of each node's best
pair (the median of all pairs would be pulled down by a slow node's n-1 pairs: on four nodes, half
of them). A pair is slow when a figure is below `SLOW` of that median, or its measurement failed.
A node all of whose pairs are slow is the culprit for them; a slow pair whose two nodes are both
fast with another node is the link between them. Each figure is also held against what the pair's
interfaces state (dscplan.network.promised): a pair below PROMISE of it is slow too, and where every
pair is, the network as a whole is named (a cluster slow alike has no outlier; two nodes have
nothing else to compare). Each finding comes with the fix to try.
"""
from __future__ import annotations

import re
import statistics

from dscnode.pairs import pair_rounds
from dscplan.network import NETWORK_FIX, PROMISE, below_promise, promised

SLOW = 0.5
METRICS = (("iperf_gbps", "iperf3", "Gbit/s"), ("allreduce_gbps", "all-reduce", "GB/s"))
NODE_FIX = ("check that node's network: `ip -s link` (errors, drops), `ethtool <nic>` (speed, "
            "duplex), `tc qdisc show` (a shaper or netem left behind), `iptables -S` (a rule dropping "
            "packets), its CPU load and NIC firmware")
LINK_FIX = ("check the path between those two: the switch port or cable, a route or rule between their "
            "addresses (`ip route get`, `tc filter show`, the firewall), an MTU mismatch "
            "(`ping -M do -s 8972` between them)")


def rounds_by_name(names):
    return [[[names[i], names[j]] for i, j in one] for one in pair_rounds(len(names))]


def times(ratio):
    """A ratio to the median in words: two decimals, two significant digits below 0.1."""
    return f"{ratio:.2g}x" if ratio < 0.1 else f"{ratio:.2f}x"


def cluster_median(names, pairs, key):
    """The median over the nodes of each node's best pair figure (None where none was measured)."""
    bests = [max((p[key] for p in pairs if n in (p["a"], p["b"]) and p[key] is not None), default=None)
             for n in names]
    bests = [b for b in bests if b is not None]
    return statistics.median(bests) if bests else None


def _slow(pair, median):
    """The reasons a pair is slow: a figure below SLOW of the cluster's median, or a
    measurement that failed."""
    why = []
    for key, label, unit in METRICS:
        value = pair.get(key)
        if value is None and pair.get(key.replace("_gbps", "_error")):
            why.append(f"{label} failed: {pair[key.replace('_gbps', '_error')]}")
        elif value is not None and median.get(key) and value < SLOW * median[key]:
            why.append(f"{label} {value:g} {unit} = {times(value / median[key])} the median")
    return why


def doctor_report(args):
    """(node names in rank order, each node's {"a b": iperf3 result of the pairs it sent in},
    train.allreduce's answer with "pairs" or None, the run's error or '', the plan's node records
    (their stated speeds; optional)) -> the report."""
    names, sent, allreduce, error, *records = args
    stated = {n["name"]: n for n in (records[0] if records else [])}
    iperf = {k: v for one in sent or [] for k, v in (one or {}).items()}
    measured = {tuple(p["nodes"]): p for p in (allreduce or {}).get("pairs") or []}
    pairs = []
    for one in rounds_by_name(names):
        for a, b in one:
            ip = iperf.get(f"{a} {b}") or {}
            ar = measured.get((names.index(a), names.index(b)))
            pairs.append({"a": a, "b": b, "iperf_gbps": ip.get("gbps"), "iperf_error": ip.get("error"),
                          "allreduce_gbps": ar["busbw_gbps"] if ar else None,
                          "allreduce_error": None if ar else (error or "not measured"),
                          "promised": promised(stated.get(a) or {}, stated.get(b) or {},
                                               (allreduce or {}).get("backend"))})
    median = {key: cluster_median(names, pairs, key) for key, _, _ in METRICS}
    for p in pairs:
        p["below_promise"] = [why for key, label, unit in METRICS
                              if (why := below_promise(p[key], p["promised"][key], label, unit))]
        p["slow"] = _slow(p, median) + p["below_promise"]
        for key, _, _ in METRICS:
            p[key.replace("_gbps", "_of_median")] = (round(p[key] / median[key], 4)
                                                      if p[key] is not None and median[key] else None)
    return {"nodes": names, "rounds": rounds_by_name(names), "pairs": pairs, "median": median,
            "slow_below": SLOW, "findings": findings(names, pairs, error)}


def findings(names, pairs, error):
    """The outliers, each {kind: node | link | join | none, subject, detail, fix}."""
    out = []
    joined = re.search(r"ranks on (\S+) exited|^(\S+): ", error or "")
    if error and not any(p["allreduce_gbps"] is not None for p in pairs):
        node = next((g for g in (joined.groups() if joined else ()) if g in names), None)
        out.append({"kind": "join", "subject": node or "the all-reduce",
                    "detail": f"{'failed to join' if node else 'did not run'}: {error}",
                    "fix": "preflight.yml checks that node's env, versions, interface and the master port"})
    if pairs and all(p["below_promise"] for p in pairs):  # slow alike: no node or link stands out
        said = "; ".join(f"{p['a']}-{p['b']}: {', '.join(p['below_promise'])}" for p in pairs)
        out.append({"kind": "network", "subject": "cluster", "fix": NETWORK_FIX,
                    "detail": f"every pair below {PROMISE:.0%} of what its interfaces state ({said})"})
        return out
    if len(names) < 3:
        judged = [f"{label} {p[key]:g} {unit} = {p[key] / p['promised'][key]:.2g}x the stated {p['promised'][key]:g}"
                  for p in pairs for key, label, unit in METRICS if p[key] is not None and p["promised"][key]]
        out.append({"kind": "none", "subject": "cluster",
                    "detail": ("two nodes: " + (f"their pair at or above {PROMISE:.0%} of what its interfaces "
                                                f"state ({'; '.join(judged)})" if judged else
                                                "one pair, and no stated speed to hold it against"))
                    if len(names) == 2 else "one node: no pair to measure",
                    "fix": "a third node tells a slow node from a slow link"})
        return out
    slow = [p for p in pairs if p["slow"]]
    culprits = [n for n in names if all(p["slow"] for p in pairs if n in (p["a"], p["b"]))]
    for n in culprits:
        mine = [p for p in pairs if n in (p["a"], p["b"])]
        figures = "; ".join(f"{p['b'] if p['a'] == n else p['a']}: {', '.join(p['slow'])}" for p in mine)
        out.append({"kind": "node", "subject": n, "detail": f"every pair with it is slow ({figures})",
                    "fix": NODE_FIX})
    for p in slow:
        if p["a"] not in culprits and p["b"] not in culprits:
            out.append({"kind": "link", "subject": f"{p['a']}-{p['b']}",
                        "detail": f"slow alone ({', '.join(p['slow'])}); {p['a']} and {p['b']} are fast "
                                  f"with the other nodes", "fix": LINK_FIX})
    if not out:
        out.append({"kind": "none", "subject": "cluster", "detail": f"no outlier: every pair at {SLOW:g}x "
                    "the median or better, on both measurements", "fix": ""})
    return out


def doctor_table(report):
    def cell(p, key, unit):
        value, ratio = p[key], p[key.replace("_gbps", "_of_median")]
        return f"{value:g} {unit} ({times(ratio)} median)" if value is not None else "failed"
    lines = ["pair | iperf3 | all-reduce (busbw) | verdict"]
    for p in report["pairs"]:
        lines.append(" | ".join([f"{p['a']}-{p['b']}", cell(p, "iperf_gbps", "Gbit/s"),
                                 cell(p, "allreduce_gbps", "GB/s"), "SLOW" if p["slow"] else "ok"]))
    for f in report["findings"]:
        lines.append(f"{f['kind'].upper()} {f['subject']}: {f['detail']}" + (f" Fix: {f['fix']}" if f["fix"] else ""))
    return lines


class FilterModule:
    def filters(self):
        return {"dsc_pair_rounds": rounds_by_name, "dsc_doctor_report": doctor_report,
                "dsc_doctor_table": doctor_table}
