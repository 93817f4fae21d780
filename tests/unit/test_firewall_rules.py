"""The toolkit's ufw rules (plugins/filter/firewall.py): which rules, in which order, and what to
delete and insert so that they lead the node's list, from ufw's own rules files. The tuples below
are as ufw 0.36 (Debian 12) writes them."""
from pathlib import Path

import pytest

import dscplan
from plugins.filter import firewall as fw

ROOT = Path(__file__).resolve().parents[2]

ADDRS = ["10.89.77.11", "10.89.77.12"]
HEX = {c: c.encode().hex() for c in ("dscluster ssh", "dscluster node", "dscluster master ports")}


def want(**kw):
    args = dict(addrs=ADDRS, ssh_port=22, ssh_sources=[], port_first=29500, port_last=29510,
                control_addr="10.89.77.1")
    args.update(kw)
    return fw.wanted(**args)


def files(rules):
    """user.rules and user6.rules text from the wanted rules (as ufw would have written them),
    with the site's tuples put before (head) or after (tail) them."""
    def text(family, head=(), tail=()):
        own = [f"### tuple ### {r['tuple']} comment={r['comment'].encode().hex()}"
               for r in rules if r["family"] == family]
        return "\n".join(["*filter", "### RULES ###", "", *head, *own, *tail, "", "### END RULES ###"])
    return text


@pytest.mark.parametrize("source,family,ufw", [
    ("192.0.2.9/24", "v4", "192.0.2.0/24"), ("::ffff:192.0.2.7", "v4", "192.0.2.7"),
    ("fe80::1%eth0", "v6", "fe80::1"), ("2001:db8::/64", "v6", "2001:db8::/64"),
    ("10.0.0.1 x", None, None), ("bastion.example.com", None, None), ("10.0.0.1\n", None, None), (" 10.0.0.1", None, None),
    ("10.0.0.1\r", None, None), ("10.0.0.1\0", None, None), ("any\n", None, None),
])
def test_the_plan_accepts_exactly_the_ssh_sources_the_rules_are_made_from(source, family, ufw):
    assert dscplan.ssh_source(source) is (family is not None)
    if family is None:
        with pytest.raises(fw.AnsibleFilterError, match="not an IP address or CIDR"):
            want(ssh_sources=[source])
    else:
        assert fw.address(source) == (family, ufw)
        assert ufw in [r["from_ip"] for r in want(ssh_sources=[source]) if r["comment"] == "dscluster ssh"]


def test_the_documented_order_ssh_then_cluster_then_the_deny_per_family():
    rules = want()
    assert [r["text"] for r in rules] == [
        "allow 22/tcp from 10.89.77.1 (v4, dscluster ssh)",
        "allow 22/tcp from 10.89.77.11 (v4, dscluster ssh)",
        "allow 22/tcp from 10.89.77.12 (v4, dscluster ssh)",
        "allow all from 10.89.77.11 (v4, dscluster node)",
        "allow all from 10.89.77.12 (v4, dscluster node)",
        "deny 29500:29510/tcp from anywhere (v4, dscluster master ports)",
        "deny 29500:29510/tcp from anywhere (v6, dscluster master ports)",
    ]
    # As ufw writes them: the deny has its IPv6 half, the IPv4 addresses stay IPv4-only.
    assert rules[-2]["tuple"] == "deny tcp 29500:29510 0.0.0.0/0 any 0.0.0.0/0 in"
    assert rules[-1]["tuple"] == "deny tcp 29500:29510 ::/0 any ::/0 in"
    assert rules[3]["tuple"] == "allow any any 0.0.0.0/0 any 10.89.77.11 in"


def test_any_only_when_asked_and_then_over_both_families():
    assert not any(r["from_ip"] in ("0.0.0.0/0", "::/0") and r["port"] == "22" for r in want())
    rules = want(ssh_sources=["any"])
    ssh = [r for r in rules if r["comment"] == "dscluster ssh"]
    assert [(r["family"], r["from_ip"]) for r in ssh] == [
        ("v4", "0.0.0.0/0"), ("v4", "10.89.77.11"), ("v4", "10.89.77.12"), ("v6", "::/0")]
    # [any] already covers the control node: no rule of its own.
    assert not any(r["from_ip"] == "10.89.77.1" for r in rules)


def test_a_local_connection_has_only_the_cluster_and_the_listed_sources():
    rules = want(control_addr="", ssh_sources=["192.0.2.0/24"])
    assert [r["from_ip"] for r in rules if r["comment"] == "dscluster ssh"] == [
        "192.0.2.0/24", "10.89.77.11", "10.89.77.12"]


@pytest.mark.parametrize("given,family,written", [
    ("10.0.0.5/32", "v4", "10.0.0.5"),
    ("10.0.0.5/8", "v4", "10.0.0.0/8"),
    ("FD89:0077:0::11", "v6", "fd89:77::11"),
    ("fd89:77::5/64", "v6", "fd89:77::/64"),
    ("2001:db8:0:0:1:0:0:1", "v6", "2001:db8::1:0:0:1"),
    ("::ffff:10.0.0.5", "v4", "10.0.0.5"),       # sshd's SSH_CLIENT on a dual-stack socket
    ("fe80::1%eth0", "v6", "fe80::1"),
])
def test_addresses_are_written_as_ufw_writes_them(given, family, written):
    assert fw.address(given) == (family, written)


def test_a_bad_source_is_refused_with_a_fix():
    with pytest.raises(Exception, match="not an IP address or CIDR. Fix"):
        want(ssh_sources=["bastion.example.com"])
    with pytest.raises(Exception, match="a list"):
        want(ssh_sources="any")


def test_ipv6_cluster_addresses_and_a_node_without_ipv6():
    rules = want(addrs=["10.0.0.1", "fd00::2"], control_addr="fd00::1")
    assert [(r["family"], r["comment"], r["from_ip"]) for r in rules if r["family"] == "v6"] == [
        ("v6", "dscluster ssh", "fd00::1"), ("v6", "dscluster ssh", "fd00::2"),
        ("v6", "dscluster node", "fd00::2"), ("v6", "dscluster master ports", "::/0")]
    assert {r["family"] for r in want(ipv6=False)} == {"v4"}


def test_a_single_master_port_and_duplicates_collapse():
    rules = want(port_first=29500, port_last=29500, control_addr="10.89.77.11")
    assert rules[-1]["port"] == "29500"
    assert [r["from_ip"] for r in rules if r["comment"] == "dscluster ssh"] == ADDRS


def test_a_fresh_node_gets_everything_appended():
    rules = want()
    ch = fw.changes(rules, "", "")
    assert ch["delete"] == [] and ch["replaced"] == []
    assert [r["text"] for r in ch["insert"]] == [r["text"] for r in rules]
    assert all(r["insert"] is None for r in ch["insert"])


def test_in_place_means_nothing_to_do():
    rules = want()
    text = files(rules)
    site4 = ["### tuple ### allow tcp 80 0.0.0.0/0 any 0.0.0.0/0 in"]
    site6 = ["### tuple ### allow tcp 80 ::/0 any ::/0 in"]
    assert fw.changes(rules, text("v4", tail=site4), text("v6", tail=site6)) == {
        "delete": [], "insert": [], "replaced": []}


def test_an_active_sites_rules_first_the_toolkits_go_ahead_of_them():
    """On a provisioned node the site ran `ufw prepend allow from 10.0.0.0/8` (IPv4 only, ahead of
    everything) and `ufw insert 1 allow 29500:29510/tcp`: ufw skipped the IPv4 half (the same
    match as the toolkit's deny) and replaced the toolkit's IPv6 deny with the allow. The
    toolkit's IPv4 rules are deleted (highest number first) and inserted ahead again, the site's
    IPv6 allow is replaced by the deny."""
    rules = want()
    text = files(rules)
    site4 = ["### tuple ### allow any any 0.0.0.0/0 any 10.0.0.0/8 in"]
    site6 = ["### tuple ### allow tcp 29500:29510 ::/0 any ::/0 in"]
    v4 = text("v4", head=site4)
    v6 = "\n".join(site6)
    ch = fw.changes(rules, v4, v6)
    # ufw status numbered: [1] the site's 10/8, [2..7] the toolkit's IPv4 rules, [8] the site's
    # IPv6 allow.
    assert [(d["number"], d["why"]) for d in ch["delete"]] == [
        (8, "same match as a toolkit rule")] + [(n, "out of order") for n in range(7, 1, -1)]
    assert ch["replaced"] == ["[8] allow tcp 29500:29510 ::/0 any ::/0 in (v6)"]
    # Then the IPv4 rules go to 1..6 ahead of the site's 10/8; the IPv6 deny, with nothing after
    # it, is appended.
    assert [r["insert"] for r in ch["insert"]] == [1, 2, 3, 4, 5, 6, None]


def test_a_sites_allow_that_replaced_the_deny_in_place_is_replaced_back():
    """`ufw allow 29500:29510/tcp` (no insert) on a provisioned node updates the toolkit's deny in
    place, both families: only that rule changes back."""
    rules = want()
    own4 = [f"### tuple ### {r['tuple']} comment={HEX[r['comment']]}" for r in rules
            if r["family"] == "v4" and r["rule"] == "allow"]
    v4 = "\n".join(own4 + ["### tuple ### allow tcp 29500:29510 0.0.0.0/0 any 0.0.0.0/0 in"])
    v6 = "### tuple ### allow tcp 29500:29510 ::/0 any ::/0 in"
    ch = fw.changes(rules, v4, v6)
    assert [d["number"] for d in ch["delete"]] == [7, 6] and len(ch["replaced"]) == 2
    assert [(r["text"], r["insert"]) for r in ch["insert"]] == [
        ("deny 29500:29510/tcp from anywhere (v4, dscluster master ports)", None),
        ("deny 29500:29510/tcp from anywhere (v6, dscluster master ports)", None)]


def test_a_new_address_is_inserted_in_its_place_and_the_rest_stays():
    old = want(addrs=ADDRS[:1])
    rules = want()
    ch = fw.changes(rules, files(old)("v4"), files(old)("v6"))
    assert ch["delete"] == []
    # ssh: control, .11, [.12 new at 3]; node: .11, [.12 new at 5]; deny kept.
    assert [(r["text"], r["insert"]) for r in ch["insert"]] == [
        ("allow 22/tcp from 10.89.77.12 (v4, dscluster ssh)", 3),
        ("allow all from 10.89.77.12 (v4, dscluster node)", 5)]


def test_the_site_keeps_its_order_and_v6_inserts_count_after_the_v4_rules():
    rules = want()
    site4 = ["### tuple ### allow any any 0.0.0.0/0 any 10.0.0.0/8 in",
             "### tuple ### allow tcp 80 0.0.0.0/0 any 0.0.0.0/0 in"]
    site6 = ["### tuple ### allow tcp 80 ::/0 any ::/0 in"]
    ch = fw.changes(rules, "\n".join(site4), "\n".join(site6))
    assert ch["delete"] == []
    # v4: 6 rules ahead of the site's 2; v6: after those 8, the deny ahead of the site's one.
    assert [r["insert"] for r in ch["insert"]] == [1, 2, 3, 4, 5, 6, 9]


def test_stale_rules_of_the_toolkit_go_and_the_sites_stay():
    old = want(addrs=ADDRS + ["10.89.77.13"], port_first=29400, port_last=29410, control_addr="10.89.77.9")
    rules = want()
    site = "### tuple ### allow tcp 443 0.0.0.0/0 any 0.0.0.0/0 in comment=" + b"site https".hex()
    ch = fw.changes(rules, files(old)("v4", tail=[site]), files(old)("v6"))
    gone = {d["text"].split("] ", 1)[1] for d in ch["delete"] if d["why"] == "stale"}
    assert "allow tcp 22 0.0.0.0/0 any 10.89.77.9 in (v4) # dscluster ssh" in gone
    assert "allow any any 0.0.0.0/0 any 10.89.77.13 in (v4) # dscluster node" in gone
    assert "deny tcp 29400:29410 ::/0 any ::/0 in (v6) # dscluster master ports" in gone
    assert not any("443" in d["text"] for d in ch["delete"])
    numbers = [d["number"] for d in ch["delete"]]
    assert numbers == sorted(numbers, reverse=True) and len(set(numbers)) == len(numbers)
    # The rules still wanted stay where they are; the new ones go in around them.
    assert {d["why"] for d in ch["delete"]} == {"stale"}
    assert [(r["text"], r["insert"]) for r in ch["insert"]] == [
        ("allow 22/tcp from 10.89.77.1 (v4, dscluster ssh)", 1),
        ("deny 29500:29510/tcp from anywhere (v4, dscluster master ports)", 6),
        ("deny 29500:29510/tcp from anywhere (v6, dscluster master ports)", None)]


def test_a_stale_node_rule_alone_is_deleted_and_nothing_inserted():
    rules = want()
    extra = "### tuple ### allow any any 0.0.0.0/0 any 10.89.77.99 in comment=" + HEX["dscluster node"]
    ch = fw.changes(rules, files(rules)("v4", tail=[extra]), files(rules)("v6"))
    assert ch["insert"] == []
    assert [(d["number"], d["why"]) for d in ch["delete"]] == [(len([r for r in rules if r["family"] == "v4"]) + 1, "stale")]


def test_the_old_toolkit_appended_after_the_site_is_moved_ahead():
    """What the toolkit did before: the same rules (the both-families ones are these two tuples),
    appended after an active site's."""
    rules = want(control_addr="")
    site4 = ["### tuple ### allow any any 0.0.0.0/0 any 10.0.0.0/8 in"]
    ch = fw.changes(rules, files(rules)("v4", head=site4), files(rules)("v6"))
    assert all(d["why"] == "out of order" for d in ch["delete"])
    # The v4 ones ahead of the site's; the v6 deny (no site rule there) is already first.
    assert [r["insert"] for r in ch["insert"]] == [1, 2, 3, 4, 5]


def test_a_comment_differing_from_the_toolkits_is_rewritten():
    rules = want()
    site = ["### tuple ### allow any any 0.0.0.0/0 any 10.89.77.11 in comment=" + b"site".hex()]
    ch = fw.changes(rules, "\n".join(site), "")
    assert ch["replaced"] == ["[1] allow any any 0.0.0.0/0 any 10.89.77.11 in (v4) # site"]


def test_application_rules_are_numbered_once():
    """ufw numbers an application rule's tuples as one rule (`ufw status numbered`, `delete NUM`)."""
    rules = want()
    app = ["### tuple ### allow tcp 80,443 0.0.0.0/0 any 0.0.0.0/0 WWW%20Full - in",
           "### tuple ### allow udp 443 0.0.0.0/0 any 0.0.0.0/0 WWW%20Full - in"]
    stale = "### tuple ### allow any any 0.0.0.0/0 any 10.89.77.99 in comment=" + HEX["dscluster node"]
    ch = fw.changes(rules, files(rules)("v4", tail=app + [stale]), files(rules)("v6"))
    n4 = len([r for r in rules if r["family"] == "v4"])
    assert [d["number"] for d in ch["delete"]] == [n4 + 2]


# firewalld (roles/cluster_network/tasks/firewalld.yml): what goes in, and what an earlier run's
# record says to take out.
def rich(src, port=22, family="ipv4"):
    return f'rule family="{family}" source address="{src}" port port="{port}" protocol="tcp" accept'


def test_firewalld_entries_put_ssh_in_every_zone_and_the_cluster_in_trusted():
    e = fw.firewalld_entries(want(), 22, ADDRS, ["public", "drop", "public"])
    assert e["ports"] == []
    assert e["rich_rules"] == [[z, rich(s)] for z in ("drop", "public")
                               for s in ("10.89.77.1", "10.89.77.11", "10.89.77.12")]
    assert e["sources"] == [["trusted", "10.89.77.11"], ["trusted", "10.89.77.12"]]


def test_firewalld_entries_open_the_port_for_any_and_keep_earlier_zones():
    before = {"rich_rules": [["work", rich("10.89.77.1")]], "ports": [], "sources": []}
    e = fw.firewalld_entries(want(ssh_sources=["any", "2001:db8::/64"]), 2222, ADDRS, ["drop"], before)
    assert e["ports"] == [["drop", "2222/tcp"], ["work", "2222/tcp"]]
    assert ["drop", rich("2001:db8::/64", 2222, "ipv6")] in e["rich_rules"]
    assert {z for z, _ in e["rich_rules"]} == {"drop", "work"}


def test_firewalld_stale_is_what_an_earlier_run_added_and_is_no_longer_wanted():
    old = fw.firewalld_entries(want(ssh_sources=["192.0.2.7"]), 22, ADDRS + ["10.89.77.13"], ["public"])
    new = fw.firewalld_entries(want(), 22, ADDRS, ["public"], old)
    assert fw.firewalld_stale(old, new) == [["rich_rules", ["public", rich("192.0.2.7")]],
                                            ["sources", ["trusted", "10.89.77.13"]]]
    assert fw.firewalld_stale(new, new) == [] and fw.firewalld_stale({}, new) == []
