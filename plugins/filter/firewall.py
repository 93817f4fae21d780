"""The toolkit's firewall rules (roles/cluster_network), what to change in ufw so that they lead
the node's rule list in order, and what to put in firewalld and take out of it.

    {{ dsc_plan.addrs | dsc_firewall_rules(ssh_port, ssh_sources, first, last, control_addr, ipv6) }}
        -> the toolkit's rules, in order: IPv4 ones, then IPv6 ones (firewalld reads the SSH ones)
    {{ wanted | dsc_ufw_changes(user_rules, user6_rules) }}
        -> {delete: [...], insert: [...], replaced: [...]}
    {{ wanted | dsc_firewalld_entries(ssh_port, addrs, zones, before) }}
        -> {ports: [[zone, "22/tcp"]], rich_rules: [[zone, rule]], sources: [["trusted", addr]]}
    {{ before | dsc_firewalld_stale(entries) }}
        -> [[kind, [zone, item]]]: what an earlier run added and this one no longer wants

ufw is first-match and keeps its rules in /etc/ufw/user.rules (IPv4) and user6.rules (IPv6), one
`### tuple ###` line per rule; `ufw status numbered` and `ufw delete NUM` number the IPv4 rules
first, then the IPv6 ones. Every rule here names its family (a source of 0.0.0.0/0 or ::/0 for
"anywhere"): ufw places the IPv6 half of a rule given for both families by its own guess, which
can land it after the site's rules. The toolkit's rules carry a comment starting with "dscluster";
that is how stale ones (an old node address, port range or SSH source) are found.
"""
from __future__ import annotations

import re

try:
    from ansible.errors import AnsibleFilterError
except ImportError:  # pure-Python unit tests
    AnsibleFilterError = ValueError

from dscplan import ip_network  # plugins/module_utils/dscplan, pure Python

COMMENT_PREFIX = "dscluster"
ANY = {"v4": "0.0.0.0/0", "v6": "::/0"}
_TUPLE = re.compile(r"^### tuple ###\s*(.*)$")


def address(text, what="address"):
    """(family, text as ufw writes it) for an address or CIDR (dscplan.ip_network): a host
    network as a plain address."""
    try:
        net = ip_network(text)
    except ValueError:
        raise AnsibleFilterError(f"{what} {text!r} is not an IP address or CIDR. Fix: an address "
                                 f"such as 192.0.2.10 or 2001:db8::10, a network such as "
                                 f"192.0.2.0/24, or 'any'.") from None
    family = "v4" if net.version == 4 else "v6"
    if net.prefixlen == net.max_prefixlen:
        return family, str(net.network_address)
    return family, str(net)


def _rule(family, action, proto, port, src, comment):
    """One single-family rule: what the ufw module is given and the tuple ufw writes for it."""
    return {
        "family": family, "rule": action, "proto": proto, "port": port, "from_ip": src,
        "comment": comment,
        "tuple": " ".join([action, proto, port or "any", ANY[family], "any", src, "in"]),
        "text": (f"{action} {port + '/' + proto if port else 'all'} from "
                 f"{'anywhere' if src == ANY[family] else src} ({family}, {comment})"),
    }


def wanted(addrs, ssh_port, ssh_sources, port_first, port_last, control_addr="", ipv6=True):
    """The toolkit's rules in first-match order, IPv4 ones then IPv6 ones: SSH on this node's port
    from the sources ('any', addresses, CIDRs), the control node (as the node sees it) and every
    cluster address; everything from the cluster's addresses; the master port range denied to
    everyone else, over both families (IPv4 only where the node has no IPv6: ufw then has none)."""
    if not isinstance(ssh_sources or [], (list, tuple)):
        raise AnsibleFilterError(f"cluster_network_ssh_sources is {ssh_sources!r}. Fix: a list, "
                                 f"e.g. [192.0.2.10] or [any].")
    sources = list(ssh_sources or [])
    opened = any(str(s).lower() == "any" for s in sources)
    ssh, node = [], []
    if opened:
        ssh += [("v4", ANY["v4"]), ("v6", ANY["v6"])]
    named = [s for s in sources if str(s).lower() != "any"]
    ssh += [address(s, "cluster_network_ssh_sources entry") for s in named]
    if control_addr and not opened:
        ssh.append(address(control_addr, "the control node's address (SSH_CLIENT)"))
    for a in addrs or []:
        fam_addr = address(a, "cluster address")
        ssh.append(fam_addr)
        node.append(fam_addr)
    first, last = int(port_first), int(port_last)
    ports = str(first) if first == last else f"{first}:{last}"
    rules = []
    for family in ("v4", "v6") if ipv6 else ("v4",):
        rules += [_rule(family, "allow", "tcp", str(int(ssh_port)), src, "dscluster ssh")
                  for fam, src in ssh if fam == family]
        rules += [_rule(family, "allow", "any", None, src, "dscluster node")
                  for fam, src in node if fam == family]
        rules.append(_rule(family, "deny", "tcp", ports, ANY[family], "dscluster master ports"))
    seen, out = set(), []
    for r in rules:
        if r["tuple"] not in seen:
            seen.add(r["tuple"])
            out.append(r)
    return out


def parse(text, family):
    """The rules of one user rules file, in ufw's order: {family, tuple, comment, match, app}."""
    out = []
    for line in (text or "").splitlines():
        m = _TUPLE.match(line.strip())
        if not m:
            continue
        body, _, hexed = m.group(1).partition(" comment=")
        try:
            comment = bytes.fromhex(hexed.strip()).decode("utf-8", "replace")
        except ValueError:
            comment = hexed.strip()
        fields = body.split()
        if not 6 <= len(fields) <= 9:
            continue  # ufw skips it too (malformed)
        if len(fields) in (6, 8):  # the old formats, without a direction: inbound
            fields.append("in")
        # action proto dport dst sport src [dapp sapp] direction (or in_eth0, in_eth0!out_eth1)
        proto, dport, dst, sport, src = fields[1:6]
        dapp, sapp = ("" if f == "-" else f for f in fields[6:8]) if len(fields) == 9 else ("", "")
        direction = fields[-1]
        out.append({
            "family": family, "tuple": " ".join(fields), "comment": comment,
            # What ufw compares to call two rules the same (all but action, logging and comment).
            "match": (fields[0].startswith("route:"), proto, dport, dst, sport, src, dapp, sapp,
                      direction),
            # An application rule may be several tuples, numbered as one.
            "app": " ".join([dapp or dport, dst, sapp or sport, src, direction]) if dapp or sapp else "",
        })
    return out


def _numbered(rules):
    """Rules as `ufw status numbered` counts them: an application rule's several tuples are one."""
    groups, seen = [], set()
    for r in rules:
        if r["app"]:
            if r["app"] in seen:
                continue
            seen.add(r["app"])
        groups.append(r)
    return groups


def _match_key(w):
    return (False, w["proto"], w["port"] or "any", ANY[w["family"]], "any", w["from_ip"], "", "", "in")


def _ours(r):
    return r["comment"].startswith(COMMENT_PREFIX)


def changes(wanted_rules, user_rules, user6_rules):
    """What to do so that the wanted rules lead each family's list in order, nothing else of the
    toolkit's remains, and the site's rules keep their order after them:
    delete: [{number, text, why}], highest number first (each deletion renumbers the later ones);
      the toolkit's rules no longer wanted (stale), those not in the leading block in order (out
      of order), and the site's rules with the same match as one of the toolkit's;
    insert: [wanted rule + {insert: number or None}], in order; the number is the rule's place in
      ufw's numbering once the earlier ones are in (IPv4 rules first, then IPv6 ones), None where
      nothing would follow it (append: ufw refuses a number past the end);
    replaced: the site's rules among the deleted (ufw keeps one rule per match, all but action
      and comment, and skips inserting the toolkit's while the site's is there).
    Already in place: both lists empty. Rules already leading in the wanted order are kept, so
    a new or removed address changes only its own rules."""
    current = {"v4": _numbered(parse(user_rules, "v4")), "v6": _numbered(parse(user6_rules, "v6"))}
    first = {"v4": 1, "v6": len(current["v4"]) + 1}
    delete, insert, replaced, plans = [], [], [], {}
    for family in ("v4", "v6"):
        want = [w for w in wanted_rules if w["family"] == family]
        index = {(w["tuple"], w["comment"]): j for j, w in enumerate(want)}
        keys = {_match_key(w) for w in want}
        kept, site, last, leading = set(), 0, -1, True
        for i, r in enumerate(current[family]):
            number = first[family] + i
            text = f"[{number}] {r['tuple']} ({family})" + (f" # {r['comment']}" if r["comment"] else "")
            j = index.get((r["tuple"], r["comment"]))
            if j is not None and leading and j > last:
                kept.add(j)
                last = j
                continue
            if j is not None:
                why = "out of order"
            elif _ours(r):
                why = "stale"
            elif r["match"] in keys:
                why = "same match as a toolkit rule"
                replaced.append(text)
            else:
                site += 1
                leading = False
                continue
            delete.append({"number": number, "text": text, "why": why})
        plans[family] = (want, kept, site)
    n4 = len(plans["v4"][0]) + plans["v4"][2]
    for family, base in (("v4", 0), ("v6", n4)):
        want, kept, site = plans[family]
        for j, w in enumerate(want):
            if j in kept:
                continue
            follows = site > 0 or any(k > j for k in kept)
            insert.append(dict(w, insert=base + j + 1 if follows else None))
    delete.sort(key=lambda d: d["number"], reverse=True)
    return {"delete": delete, "insert": insert, "replaced": replaced}


FIREWALLD_KINDS = ("ports", "rich_rules", "sources")


def firewalld_entries(rules, ssh_port, addrs, zones, before=None):
    """What the toolkit puts in firewalld, as {kind: [[zone, item], ...]}: SSH in every zone of
    `zones` and every zone an earlier run (`before`, the node's record) opened it in, as a port
    when a source is anywhere, else one rich rule per source of the toolkit's SSH rules (`rules`,
    from wanted()); the cluster's addresses as sources of the trusted zone. Sorted zones: the
    same wanted state gives the same record."""
    before = before or {}
    zones = sorted(set(zones) | {z for kind in ("ports", "rich_rules") for z, _ in before.get(kind, [])})
    ssh = [r for r in rules if r["comment"] == "dscluster ssh"]
    port = int(ssh_port)
    rich = [f'rule family="{"ipv4" if r["family"] == "v4" else "ipv6"}" source address="{r["from_ip"]}" '
            f'port port="{port}" protocol="tcp" accept' for r in ssh if r["from_ip"] != ANY[r["family"]]]
    anywhere = len(rich) < len(ssh)
    return {"ports": [[z, f"{port}/tcp"] for z in zones] if anywhere else [],
            "rich_rules": [[z, rule] for z in zones for rule in rich],
            "sources": [["trusted", a] for a in addrs or []]}


def firewalld_stale(before, entries):
    """[kind, [zone, item]] for each entry an earlier run recorded that is no longer wanted."""
    return [[kind, e] for kind in FIREWALLD_KINDS for e in (before or {}).get(kind, [])
            if e not in entries.get(kind, [])]


class FilterModule:
    def filters(self):
        return {
            "dsc_firewall_rules": wanted,
            "dsc_ufw_changes": changes,
            "dsc_firewalld_entries": firewalld_entries,
            "dsc_firewalld_stale": firewalld_stale,
        }
