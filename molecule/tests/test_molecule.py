"""`molecule test` (syntax, idempotence, verify) on the same container cluster, provisioned by the
`provisioned` fixture: the idempotence step is the check that a second provision changes nothing."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_molecule_scenario_passes(provisioned, cluster):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", NO_COLOR="1",
               DSC_TEST_STATE=str(cluster.inventory.parent))
    env.pop("ANSIBLE_CONFIG", None)  # molecule writes its own from molecule.yml
    r = subprocess.run([str(Path(sys.executable).parent / "molecule"), "test"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    for action in ("syntax", "idempotence", "verify"):
        assert f"{action}: Executed: Successful" in " ".join(out.split()), action
