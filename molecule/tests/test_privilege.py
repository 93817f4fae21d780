"""The privilege boundary on the container cluster: the training user owns the env, so nothing
running as root may execute it. A .pth file planted in the env's site-packages by the training
user runs with every interpreter start of that env; it records who ran it."""
import json

PTH = "/opt/dscluster/env/lib/python3.11/site-packages/zz_who_runs_me.pth"
SEEN = "/tmp/who-ran-the-env"


def test_root_never_runs_the_training_users_env(provisioned, cluster, tmp_path):
    for n in cluster.names:
        cluster.exec(n, f"rm -f {SEEN}; touch {SEEN}; chmod 666 {SEEN}")
        cluster.exec(n, f"echo \"import os; open('{SEEN}', 'a').write(str(os.getuid()) + chr(10))\" > {PTH}",
                     user="dstrain")
    try:
        for playbook, args in [("provision.yml", []),
                               ("preflight.yml", ["-e", f"preflight_report_dir={tmp_path}", "-e", "preflight_full=false"]),
                               ("launch.yml", ["-e", "run_id=priv-1", "-e", "follow=true", "-e",
                                               json.dumps({"dsc_train_config": {"steps": 2, "vocab_size": 512, "seq_len": 64}})]),
                               ("status.yml", ["-e", "run_id=priv-1"]),
                               ("stop.yml", ["-e", "run_id=priv-1"])]:
            r = cluster.playbook(playbook, *args)
            assert r.returncode == 0, (playbook, r.output[-3000:])
        for n in cluster.names:
            uids = cluster.exec(n, f"cat {SEEN}").stdout.split()
            assert uids, f"{n}: the planted .pth never ran (the test proves nothing)"
            assert "0" not in uids, f"{n}: root ran the training user's env: {uids}"
    finally:
        for n in cluster.names:
            cluster.exec(n, f"rm -f {PTH} {SEEN}", check=False)
