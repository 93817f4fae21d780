"""`molecule test` (syntax, idempotence, verify) on the same container cluster, provisioned by the
`provisioned` fixture: the idempotence step is the check that a second provision changes nothing."""
import os
import subprocess
import sys
from pathlib import Path

import cluster as testcluster
from dscnode import warm_record

ROOT = Path(__file__).resolve().parents[2]
# Root's record of the warm-up's last complete answer for the install root's JIT cache.
RECORD = warm_record(testcluster.EXT_DIR)


def test_molecule_scenario_passes(provisioned, cluster, earlier_tests, tmp_path):
    # molecule's idempotence step runs only on a converged scenario: the `provisioned` fixture's
    # provision is its converge, with nothing run on the cluster since. The other files' tests
    # change what provision checks (test_own_scripts installs requirements into the env,
    # test_trust plants and removes files in it: the warm-up's record then no longer answers,
    # rightly), so this test runs first on its cluster (conftest.py; scripts/suite.py's
    # --no-loadscope-reorder). molecule records a converge in its own state file, which a fresh
    # machine does not have: this run's state says so (a scenario directory of its own).
    assert earlier_tests == [], (f"{earlier_tests[:3]} ran on this cluster before molecule's idempotence step: "
                                 "under pytest-xdist, pass --no-loadscope-reorder")
    (tmp_path / "state.yml").write_text("---\nconverged: true\n")
    records = {n: cluster.exec(n, f"stat -c %y {RECORD}").stdout for n in cluster.names}
    # molecule.yml names the project's ansible.cfg; this cluster's fact cache and SSH sockets are
    # its own, as for every playbook the tests run (cluster.Cluster.playbook).
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", NO_COLOR="1",
               DSC_TEST_STATE=str(cluster.inventory.parent), MOLECULE_EPHEMERAL_DIRECTORY=str(tmp_path),
               ANSIBLE_CACHE_PLUGIN_CONNECTION=str(testcluster.FACTS),
               ANSIBLE_SSH_CONTROL_PATH_DIR=str(testcluster.STATE / "cp"))
    r = subprocess.run([str(Path(sys.executable).parent / "molecule"), "test"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    for action in ("syntax", "idempotence", "verify"):
        assert f"{action}: Executed: Successful" in " ".join(out.split()), action
    # Root's record of the warm-up was not rewritten on any node (the idempotence run found it current).
    assert records == {n: cluster.exec(n, f"stat -c %y {RECORD}").stdout for n in cluster.names}
