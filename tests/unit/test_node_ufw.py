"""cluster_network's ufw changes in one call (dscnode.ufw, the node helper's ufw-apply): the ufw
commands formed from dsc_ufw_changes' output, deletions highest first, then insertions as
community.general.ufw forms them; anything not of the form dsc_ufw_changes writes refused before
any ufw command runs. The commands' effect on a real ufw: molecule/tests/test_network.py.

    .venv/bin/pytest tests/unit/test_node_ufw.py -q
"""
import json

import pytest

from dscnode import ufw
from plugins.filter import firewall
from tests.unit.node_helpers import helper

SITE = "*filter\n### tuple ### allow tcp 22 0.0.0.0/0 any 192.0.2.99 in comment=73697465\n"
STALE = "### tuple ### allow any any 0.0.0.0/0 any 10.0.0.9 in comment=" + b"dscluster node".hex() + "\n"


def test_changes_become_ufw_commands_deletions_first_highest_first():
    wanted = firewall.wanted(["10.0.0.1", "10.0.0.2"], 22, [], 29500, 29510, "10.0.0.100", ipv6=True)
    changes = firewall.changes(wanted, SITE + STALE + STALE.replace("10.0.0.9", "10.0.0.8"), "")
    cmds = ufw.commands(changes)
    assert cmds[:2] == [["ufw", "--force", "delete", "3"], ["ufw", "--force", "delete", "2"]]
    assert cmds[2] == ["ufw", "insert", "1", "allow", "from", "10.0.0.100", "to", "any", "port", "22", "proto", "tcp",
                       "comment", "dscluster ssh"]
    node = next(c for c in cmds if c[-1] == "dscluster node")
    assert node[3:] == ["allow", "from", "10.0.0.1", "to", "any", "comment", "dscluster node"]  # any protocol
    deny = [c for c in cmds if "deny" in c]
    assert [c[c.index("from") + 1] for c in deny] == ["0.0.0.0/0", "::/0"] and all("29500:29510" in c for c in deny)
    assert len(cmds) == 2 + len(changes["insert"])


@pytest.mark.parametrize("bad", [
    {"delete": [{"number": "1; reboot"}]}, {"delete": [{"number": 0}]}, {"delete": [{"number": True}]},
    {"insert": [{"rule": "allow; id", "proto": "tcp", "from_ip": "10.0.0.1", "comment": "dscluster ssh"}]},
    {"insert": [{"rule": "allow", "proto": "icmp", "from_ip": "10.0.0.1", "comment": "dscluster ssh"}]},
    {"insert": [{"rule": "allow", "proto": "tcp", "from_ip": "10.0.0.1 to any", "comment": "dscluster ssh"}]},
    {"insert": [{"rule": "allow", "proto": "tcp", "port": "22 proto udp", "from_ip": "10.0.0.1", "comment": "dscluster ssh"}]},
    {"insert": [{"rule": "allow", "proto": "tcp", "from_ip": "10.0.0.1", "comment": "site's rule"}]},
    {"insert": [{"rule": "allow", "proto": "tcp", "from_ip": "10.0.0.1", "comment": "dscluster ssh", "insert": -1}]},
    {"insert": [{"rule": "allow", "proto": "tcp", "from_ip": "10.0.0.1", "comment": "dscluster ssh", "insert": 0}]},
    {"insert": "allow all"},
    {"insert": [{"rule": "allow", "proto": "tcp", "from_ip": "10.0.0.1\n", "comment": "dscluster ssh"}]},
    {"insert": [{"rule": "allow", "proto": "tcp", "from_ip": "../10.0.0.1", "comment": "dscluster ssh"}]},
    {"insert": [{"rule": "allow", "proto": "tcp", "from_ip": "10.0.0.1", "port": "22\n", "comment": "dscluster ssh"}]},
    {"insert": [{"rule": "allow", "proto": "tcp", "from_ip": "10.0.0.1", "comment": "dscluster $(id)"}]},
    {"insert": [{"rule": "allow", "proto": "tcp", "from_ip": "10.0.0.1", "comment": "dscluster ssh\n"}]},
    {"insert": [{"rule": "allow", "proto": "tcp", "from_ip": "10.0.0.1", "comment": "dscluster ssh; reboot"}]},
    {"insert": [{"rule": "allow", "proto": "tcp", "from_ip": "10.0.0.1", "comment": "#jinja2: variable_start_string:'[['"}]},
])
def test_hostile_or_malformed_changes_are_refused_before_ufw_runs(bad):
    out = json.loads(helper("ufw-apply", stdin=json.dumps(bad)).stdout)
    assert out["ok"] is False and out["commands"] == [] and out["error"].startswith("refused before any change")
