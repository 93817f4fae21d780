"""cluster_network's ufw changes in one call per node (`dsc_node.pyz ufw-apply`, as root): the
toolkit's stale or misplaced rules deleted by number, highest first (each deletion renumbers the
rules after it), then its own inserted at their places, one `ufw` command each, as
community.general.ufw would form them, without that module's four ufw runs per rule and one module
call per rule (a node gets a rule per cluster address: per node that grew with the cluster, across
the cluster with its square). The changes come from plugins/filter/firewall.py (dsc_ufw_changes);
every field is checked again here before ufw runs, and no shell is involved."""
import ipaddress
import re

from dscnode.procs import run

ACTIONS = {"allow", "deny", "reject", "limit"}
PROTOS = {"tcp", "udp", "any"}
PORTS = re.compile(r"[0-9]{1,5}(:[0-9]{1,5})?")
COMMENT = re.compile(r"dscluster[A-Za-z0-9 ._-]{0,60}")


def _number(value, what):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} is {value!r}: a rule number from 1")
    return value


def commands(changes):
    """The ufw commands for {delete: [{number}], insert: [{rule, proto, port, from_ip, comment,
    insert}]}, in the order they must run; ValueError naming the field that is not as
    dsc_ufw_changes writes it."""
    out = [["ufw", "--force", "delete", str(_number(n, "delete number"))]
           for n in sorted((d["number"] for d in changes.get("delete") or []), reverse=True)]
    for r in changes.get("insert") or []:
        if r.get("rule") not in ACTIONS or r.get("proto") not in PROTOS:
            raise ValueError(f"rule {r.get('rule')!r} proto {r.get('proto')!r}: one of {sorted(ACTIONS)}, {sorted(PROTOS)}")
        ipaddress.ip_network(str(r.get("from_ip")), strict=False)  # ValueError where it is not one
        port, comment = r.get("port") or "", r.get("comment")
        if port and not PORTS.fullmatch(str(port)):
            raise ValueError(f"port {port!r}: a port or a range FIRST:LAST")
        if not isinstance(comment, str) or not COMMENT.fullmatch(comment):
            raise ValueError(f"comment {comment!r}: the toolkit's comments start with 'dscluster'")
        at = ["insert", str(_number(r["insert"], "insert number"))] if r.get("insert") is not None else []
        out.append(["ufw", *at, r["rule"], "from", str(r["from_ip"]), "to", "any",
                    *(["port", str(port)] if port else []), *(["proto", r["proto"]] if r["proto"] != "any" else []),
                    "comment", comment])
    return out


def rule_files(folder="/etc/ufw"):
    """ufw's rules as it keeps them (user.rules, user6.rules; "" where missing): what the probe
    reports before a provision and ufw-apply after its commands."""
    texts = []
    for name in ("user.rules", "user6.rules"):
        try:
            with open(f"{folder}/{name}", errors="replace") as f:
                texts.append(f.read())
        except OSError:
            texts.append("")
    return texts


def apply(changes):
    """{ok, commands, error, rules}: each command run in order, the first that fails ending it;
    `rules`: ufw's rule files after them, which the role checks lead with the toolkit's rules."""
    try:
        todo = commands(changes)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return {"ok": False, "commands": [], "error": f"refused before any change: {e}", "rules": []}
    done, error = [], ""
    for cmd in todo:
        rc, out, err = run(cmd, timeout=120)
        done.append(" ".join(cmd))
        if rc != 0:
            error = (err or out).strip()[-2000:]
            break
    return {"ok": not error, "commands": done, "error": error, "rules": rule_files()}
