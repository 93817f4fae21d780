"""The privilege boundary on the container cluster: the training user owns the env, so nothing
running as root may execute it. A .pth file planted in the env's site-packages by the training
user runs with every interpreter start of that env; it records who ran it, through provision and
preflight as root and a whole run cycle with Ansible as an ordinary user with sudo."""
import json
import shutil

from cluster import TINY, UNTIL_STOPPED

PTH = "/opt/dscluster/env/lib/python3.11/site-packages/zz_who_runs_me.pth"
SEEN = "/tmp/who-ran-the-env"


# The env's console scripts, each swapped by the training user for one that records who runs it.
SWAPPED = "deepspeed ds_report pip ninja"
BIN = "/opt/dscluster/env/bin"
ROOT_OWNED = "/usr/local/lib/dscluster /usr/local/lib/dscluster/dsc_node.pyz /srv/victim /etc/ssh"


def test_root_never_runs_the_training_users_env(provisioned, cluster, tmp_path):
    """With the .pth and the swapped scripts planted: provision.yml and preflight.yml as root, then
    the whole run cycle with Ansible as an ordinary user with sudo (the example inventory's
    `ubuntu`): launch, the second-launch guard, status, stop and resume see the training user's
    processes, which that user may not signal (EPERM is alive, not dead). Neither root nor that
    user runs the env (a task that ran it as the user Ansible connects as would run it as root
    where Ansible connects as root)."""
    owners, ops_uids = {}, set()
    for n in cluster.names:
        cluster.exec(n, f"rm -f {SEEN}; touch {SEEN}; chmod 666 {SEEN}; install -d -m 0755 /srv/victim")
        cluster.exec(n, f"echo \"import os; open('{SEEN}', 'a').write(str(os.getuid()) + chr(10))\" > {PTH}",
                     user="dstrain")
        cluster.exec(n, f"""cd {BIN} && for f in {SWAPPED}; do test -e $f.real || mv $f $f.real
cat > $f <<'WRAPPER'
#!/bin/sh
id -u >> {SEEN}
exec "$0.real" "$@"
WRAPPER
chmod 755 $f; done""", user="dstrain")
        owners[n] = cluster.exec(n, f"stat -c '%n %U %a' {ROOT_OWNED}").stdout
        cluster.exec(n, "id ops >/dev/null 2>&1 || useradd -m -s /bin/bash ops; "
                        "echo 'ops ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/ops && chmod 0440 /etc/sudoers.d/ops; "
                        "install -d -m 0700 -o ops -g ops /home/ops/.ssh && "
                        "install -m 0600 -o ops -g ops /root/.ssh/authorized_keys /home/ops/.ssh/authorized_keys; "
                        "rm -rf /opt/dscluster/runs/ops-1")
        ops_uids.add(cluster.exec(n, "id -u ops").stdout.strip())
    inventory = tmp_path / "inventory"
    shutil.copytree(cluster.inventory, inventory)
    all_yml = inventory / "group_vars" / "all.yml"
    all_yml.write_text(all_yml.read_text().replace("ansible_user: root", "ansible_user: ops"))

    def play(name, *args):
        return cluster.playbook(name, *args, inventory=inventory)
    train = ["-e", json.dumps({"dsc_train_config": dict(TINY, **UNTIL_STOPPED, save_every=10)})]
    ended = False
    try:
        for playbook, args in [("provision.yml", []),
                               ("preflight.yml", ["-e", f"preflight_report_dir={tmp_path}", "-e", "preflight_full=false"])]:
            r = cluster.playbook(playbook, *args)
            assert r.returncode == 0, (playbook, r.output[-3000:])
        r = play("launch.yml", "-e", "run_id=ops-1", *train)
        assert r.returncode == 0 and "ansible_user" not in r.output, r.output[-3000:]
        cluster.wait_checkpoint("ops-1", 10)
        second = play("launch.yml", "-e", "run_id=ops-2")
        assert second.returncode != 0 and "run ops-1 is active" in second.output, second.output[-3000:]
        status = play("status.yml")
        for n in cluster.names:
            assert f"{n}: running, ranks alive 1" in status.output, status.output[-3000:]
        stop = play("stop.yml")
        assert stop.returncode == 0, stop.output[-3000:]
        for n in cluster.names:
            assert f"{n}: stopped" in stop.output and cluster.rank_pids(n, "ops-1") == [], n
        saved = max(set.intersection(*(cluster.complete_steps(n, "ops-1") for n in cluster.names)))
        resumed = play("resume.yml", "-e", "run_id=ops-1", "-e", "follow=true", "-e", "preflight=false",
                       "-e", json.dumps({"dsc_entry_args": ["--set", f"steps={saved + 4}"]}))
        assert resumed.returncode == 0 and "finished" in resumed.output, resumed.output[-3000:]
        assert cluster.run_status("ops-1")["state"] == "finished"
        ended = True  # followed to its end: nothing of the run is left for stop.yml
        _a_link_at_the_next_default_run_id_is_refused(cluster)
        for n in cluster.names:
            uids = cluster.exec(n, f"cat {SEEN}").stdout.split()
            assert uids, f"{n}: the planted .pth and scripts never ran (the test proves nothing)"
            assert not {"0", *ops_uids} & set(uids), f"{n}: root or the Ansible user ran the training user's env: {uids}"
            assert cluster.exec(n, f"stat -c '%n %U %a' {ROOT_OWNED}").stdout == owners[n]
            assert cluster.exec(n, "ls -A /srv/victim").stdout == "", f"{n}: a run wrote into /srv/victim"
    finally:
        if not ended:
            play("stop.yml", "-e", "run_id=ops-1")
        for n in cluster.names:
            cluster.exec(n, f"rm -f {PTH} {SEEN}; cd {BIN} && for f in {SWAPPED}; do "
                            f"test -e $f.real && mv -f $f.real $f; done; true", check=False)


def _a_link_at_the_next_default_run_id_is_refused(cluster):
    """The training user plants a link at every default run id of the next minutes (the ids are
    <preset>-<UTC time>): the launch is refused before any node changes."""
    plant = ("now=$(date -u +%s); for k in $(seq 0 300); do "
             "ln -sfn /srv/victim /opt/dscluster/runs/zero2-$(date -u -d @$((now + k)) +%Y%m%d-%H%M%S); done")
    for n in cluster.names:
        cluster.exec(n, plant, user="dstrain")
    try:
        r = cluster.playbook("launch.yml", "-e", "preset=zero2")
        assert r.returncode != 0 and "is a symbolic link, not a run directory" in r.output, r.output[-3000:]
    finally:
        for n in cluster.names:
            cluster.exec(n, "find /opt/dscluster/runs -maxdepth 1 -type l -name 'zero2-*' -delete")
