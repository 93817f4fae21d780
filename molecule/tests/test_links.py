"""Links on a shared node (the container cluster): the training user replaces every path that
provision, launch, stop and status write into as root (or as that user inside their
directories) by a link to a root-owned victim directory, in two rounds (the directories, then
the paths inside them: a link inside a linked directory would land in the victim). Every
playbook is refused by the plan, before any node changes, naming each linked path (the plan
lists every problem it finds; dsc_data_dir: launch only, the one that syncs it); the victim's
owner, mode and contents never change. The cluster ends as it began."""
import json
import os
import re
import shutil

VICTIM = "/srv/victim-links"
DATA = "/tmp/dscluster-links-data"
HOME = "/home/dstrain"
# Each path the training user can replace (the directories above are root's: /opt, /home, /srv).
PATHS = ["/opt/dscluster/cache", "/opt/dscluster/cache/torch_extensions", "/opt/dscluster/wheelhouse",
         "/opt/dscluster/lock-wheels.txt", "/opt/dscluster/lock-sdists.txt", "/opt/dscluster/ds_report.txt",
         "/opt/dscluster/runs", f"{HOME}/.ssh", f"{HOME}/.ssh/authorized_keys", f"{HOME}/.ssh/known_hosts",
         f"{HOME}/.ssh/config", f"{HOME}/.ssh/id_ed25519", DATA]
PLAYBOOKS = [("provision.yml", []), ("launch.yml", ["-e", "run_id=links-1", "-e", "dry_run=true"]),
             ("stop.yml", ["-e", "run_id=links-1"]), ("status.yml", ["-e", "run_id=links-1"])]
SEEN = f"stat -c '%U %G %a' {VICTIM}; ls -la --time-style=+ {VICTIM} | tail -n +2; sha256sum {VICTIM}/*"


def test_a_link_at_every_path_root_touches_is_refused(provisioned, cluster):
    node = cluster.names[0]  # the master: every path is touched there
    cluster.exec(node, f"install -d -m 0755 -o root -g root {VICTIM} && echo keep > {VICTIM}/file "
                       f"&& chmod 0644 {VICTIM}/file")
    before = cluster.exec(node, SEEN).stdout
    os.makedirs(DATA, exist_ok=True)  # the control node's dataset (the source)
    with open(f"{DATA}/part-0.txt", "w") as f:
        f.write("data\n")
    try:
        inside = [p for p in PATHS if any(p.startswith(q + "/") for q in PATHS)]
        for paths in ([p for p in PATHS if p not in inside], inside):  # the directories, then inside them
            # As the training user: what is there moves aside (restored below), a link takes its place.
            cluster.exec(node, "; ".join(f"if test -e {p} -o -L {p}; then mv {p} {p}.links-aside; fi; "
                                         f"ln -s {VICTIM} {p}" for p in paths), user="dstrain")
            try:
                for playbook, args in PLAYBOOKS:
                    data = ["-e", json.dumps({"dsc_data_dir": DATA})] if playbook == "launch.yml" else []
                    r = cluster.playbook(playbook, *args, *data)
                    assert r.returncode != 0, (paths, playbook, "not refused", r.output[-2000:])
                    for path in paths:
                        if path == DATA and playbook != "launch.yml":
                            continue  # only launch syncs the dataset
                        assert f"{path} is a link to {VICTIM}" in r.output, (path, playbook, r.output[-3000:])
                    assert not re.search(r"changed=[1-9]", r.output), (paths, playbook, r.output[-2000:])
                    assert cluster.exec(node, SEEN).stdout == before, (paths, playbook, "the victim changed")
            finally:
                cluster.exec(node, "; ".join(f"rm -f {p}; if test -e {p}.links-aside -o -L {p}.links-aside; "
                                             f"then mv {p}.links-aside {p}; fi" for p in paths),
                             user="dstrain", check=False)
        assert cluster.exec(node, SEEN).stdout == before
    finally:
        cluster.exec(node, f"rm -rf {VICTIM}", check=False)
        shutil.rmtree(DATA, ignore_errors=True)
