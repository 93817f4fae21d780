"""The paths root makes, writes and runs, as the plan checks them (dscplan.settings, packages):
system directories refused as roots and directories of their own accepted, who runs an existing
interpreter (root, its one owner, or refused), the data dir, and the probe's root_paths (a link,
a foreign owner, another user's directory above the install root).

    .venv/bin/pytest tests/unit/test_plan_paths.py -q
"""
import pytest

import dscplan
from tests.unit.plan_helpers import DEFAULTS, PATHS, cluster, plan


@pytest.mark.parametrize("settings,options,needle", [
    ({"dsc_install_root": "/"}, None, "dsc_install_root on host node1 is '/', the root directory"),
    ({"dsc_install_root": "/etc"}, None, "dsc_install_root on host node1 is '/etc', in the system tree /etc"),
    ({"dsc_install_root": "/usr/local/dscluster"}, None, "is '/usr/local/dscluster', in the system tree /usr"),
    ({"dsc_install_root": "/var"}, None, "is '/var', the system directory /var itself"),
    ({"dsc_install_root": "/home/"}, None, "is '/home/', the system directory /home itself"),
    ({"dsc_install_root": "//etc"}, None, "is '//etc', in the system tree /etc"),
    ({"dsc_install_root": "/lib64/x"}, None, "in the system tree /lib64"),
    ({"dsc_run_root": "/"}, None, "dsc_run_root on host node1 is '/', the root directory"),
    ({"dsc_run_root": "/etc"}, None, "dsc_run_root on host node1 is '/etc', in the system tree /etc"),
    ({"dsc_run_root": "/tmp"}, None, "dsc_run_root on host node1 is '/tmp', the system directory /tmp itself"),
    ({"dsc_run_root": "/var/run/ds"}, None, "in the system tree /var/run"),
    ({"dsc_run_root": "/root/runs"}, None, "in the system tree /root"),
    ({"dsc_install_root": "/var/lib/dscluster"}, None, "in /var/lib/dscluster, where root keeps what only root may write"),
    ({"dsc_data_dir": "/var/lib/dscluster/packages", "dsc_data_shared": True}, None, "in /var/lib/dscluster, where root"),
    ({"dsc_run_root": "/proc/1/cwd"}, None, "in the system tree /proc"),
    ({"dsc_data_dir": "/etc", "dsc_data_shared": True}, None, "dsc_data_dir on host node1 is '/etc', in the system tree /etc"),
    ({"dsc_data_dir": "/"}, None, "dsc_data_dir on host node1 is '/', the root directory, and launch makes it the training user's and syncs"),
    ({"dsc_data_dir": "/boot"}, None, "dsc_data_dir on host node1 is '/boot'"),
    ({"dsc_env_manager": "existing", "dsc_existing_python": "/bin/python3"}, None,
     "dsc_existing_python on host node1 is '/bin/python3', whose env '/' is the root directory"),
    ({"dsc_env_manager": "existing", "dsc_existing_python": "/tmp/bin/python"}, None,
     "whose env '/tmp' is the system directory /tmp itself"),
    ({"dsc_env_manager": "existing", "dsc_existing_python": "/root/.venv/bin/python"}, None,
     "whose env '/root/.venv' is in the system tree /root"),
    ({"dsc_env_manager": "existing", "dsc_existing_python": "/opt/torch/python"}, None,
     "not in an env's bin directory"),
    ({}, {"dsc_code_dir": "/usr", "dsc_code_shared": True}, "dsc_code_dir (dsc_code_shared) is '/usr', in the system tree /usr"),
    ({}, {"dsc_code_dir": "/", "dsc_code_shared": True}, "dsc_code_dir (dsc_code_shared) is '/', the root directory"),
])
def test_system_directories_are_refused_as_roots(settings, options, needle):
    """A root the toolkit gives to the training user (and the dataset's, synced with delete)
    is never /, a system tree or a shared root itself, before any node changes."""
    p, errors = plan(options=options, full_run=options is not None, **settings)
    assert p is None and any(needle in e and "Fix: a directory of the toolkit's own" in e
                             or needle in e and "Fix: the interpreter of an env of its own" in e
                             for e in errors), errors


@pytest.mark.parametrize("settings", [
    {"dsc_install_root": "/opt/dscluster", "dsc_run_root": "/var/lib/dsc-runs"},
    {"dsc_run_root": "/home/alice/runs"}, {"dsc_run_root": "/tmp/dsc-runs"}, {"dsc_install_root": "/srv/ds/"},
    {"dsc_data_dir": "/mnt/datasets/c4", "dsc_data_shared": True}, {"dsc_run_root": "/library/runs"},
    {"dsc_env_manager": "existing", "dsc_existing_python": "/usr/bin/python3"},
    {"dsc_env_manager": "existing", "dsc_existing_python": "/usr/local/bin/python3"},
    {"dsc_env_manager": "existing", "dsc_existing_python": "/opt/conda/envs/ds/bin/python"},
])
def test_directories_of_their_own_under_shared_roots_are_accepted(settings):
    hostvars, groups, probes = cluster(2, **settings)
    for pr in probes.values():
        pr["existing_python"] = owned(settings.get("dsc_existing_python", ""))
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert errors == [], errors


def owned(py, owners=(), mode="0o755"):
    """What the probe reports of an interpreter (dscnode.probe.path_owners): each directory above it
    root's, then the ones named in `owners` ({path: (uid, user)}), every mode `mode`."""
    parts = py.split("/")[1:]
    chain = ["/"] + ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]
    owners = dict(owners)
    return {"path": py, "entries": [
        {"path": p, "uid": owners.get(p, (0, "root"))[0], "user": owners.get(p, (0, "root"))[1],
         "mode": mode if p != py else "0o755", "kind": "file" if p == py else "dir"} for p in chain]}


def existing_plan(reports):
    py = "/opt/torch/.venv/bin/python"
    hostvars, groups, probes = cluster(2, dsc_env_manager="existing", dsc_existing_python=py)
    for node, report in zip(probes, reports, strict=True):
        if report is not None:
            probes[node]["existing_python"] = report
    return dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)


def test_an_existing_interpreter_runs_as_root_only_when_it_is_roots_alone():
    py = "/opt/torch/.venv/bin/python"
    p, errors = existing_plan([owned(py), owned(py)])
    assert errors == [] and p["env_owner"] == "root"
    users = {"/opt/torch": (1001, "dstrain"), "/opt/torch/.venv": (1001, "dstrain")}
    p, errors = existing_plan([owned(py, users), owned(py, users)])
    assert errors == [] and p["env_owner"] == "dstrain"  # run only as its owner, never as root


@pytest.mark.parametrize("reports,needle", [
    ([owned("/opt/torch/.venv/bin/python", mode="0o775")] * 2,
     "dsc_existing_python on host node1 is '/opt/torch/.venv/bin/python': / is writable by group (mode 775, owner root)"),
    ([owned("/opt/torch/.venv/bin/python", {"/opt/torch/.venv/bin": (0, "root")}, mode="0o757")] * 2,
     "is writable by others (mode 757, owner root)"),
    ([owned("/opt/torch/.venv/bin/python", {"/opt/torch": (1001, "dstrain"), "/opt/torch/.venv": (1002, "alice")})] * 2,
     "parts of it belong to alice, dstrain (not only root)"),
    ([{"path": "/opt/torch/.venv/bin/python", "error": "/opt/torch/.venv/bin/python is not a file"}] * 2,
     "dsc_existing_python on host node1 is '/opt/torch/.venv/bin/python', which is not there"),
    ([owned("/opt/torch/.venv/bin/python"), None], "node2 is '/opt/torch/.venv/bin/python', which is not there (the probe did not look at it)"),
    ([owned("/opt/torch/.venv/bin/python"), owned("/opt/torch/.venv/bin/python", {"/opt/torch": (1001, "dstrain")})],
     "owned by root on node1; dstrain on node2"),
])
def test_an_existing_interpreter_others_could_change_is_refused_saying_why(reports, needle):
    p, errors = existing_plan(reports)
    assert p is None and any(needle in e and "Fix:" in e for e in errors), errors


def test_data_dir_synced_or_shared(tmp_path):
    p, errors = plan(dsc_data_dir=str(tmp_path) + "/")
    assert errors == [] and (p["data_dir"], p["data_shared"]) == (str(tmp_path), False)
    p, errors = plan(dsc_data_dir="/shared/datasets/c4", dsc_data_shared=True)  # checked by preflight
    assert errors == [] and p["data_shared"] is True


def chain(*entries):
    """A probe's lstat chain: (path, kind, user[, target]) each."""
    return [dict({"path": p, "kind": k, "uid": 0 if u == "root" else 1000, "user": u, "mode": "0o755"},
                 **({"target": t[0]} if t else {})) for p, k, u, *t in entries]


def root_paths(*extra):
    base = [{"var": "dsc_install_root", "path": "/opt/dscluster", "role": "made",
             "chain": chain(("/", "dir", "root"), ("/opt", "dir", "root"), ("/opt/dscluster", "dir", "dstrain"))}]
    return base + list(extra)


def plan_with_paths(report, full_run=False, **settings):
    hostvars, groups, probes = cluster(1, **settings)
    probes["node1"]["root_paths"] = report
    return dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {}, now="20261130-000000",
                              full_run=full_run, check_dir=lambda p: True)


def test_clean_root_paths_pass():
    p, errors = plan_with_paths(root_paths(
        {"var": "dsc_install_root", "path": "/opt/dscluster/cache", "role": "user",
         "chain": chain(("/", "dir", "root"), ("/opt", "dir", "root"), ("/opt/dscluster", "dir", "dstrain"),
                        ("/opt/dscluster/cache", "dir", "dstrain"))}))
    assert errors == [] and p["node"]["node1"]["local"] is False


@pytest.mark.parametrize("entry,needles", [
    ({"var": "dsc_install_root", "path": "/opt/dscluster/cache/torch_extensions", "role": "user",
      "chain": chain(("/", "dir", "root"), ("/opt", "dir", "root"), ("/opt/dscluster", "dir", "dstrain"),
                     ("/opt/dscluster/cache", "link", "dstrain", "/etc"))},
     ["dsc_install_root on host node1: root writes /opt/dscluster/cache/torch_extensions",
      "/opt/dscluster/cache is a link to /etc owned by dstrain", "Fix: remove the link (rm /opt/dscluster/cache"]),
    ({"var": "dsc_train_user", "path": "/home/dstrain/.ssh", "role": "user",
      "chain": chain(("/", "dir", "root"), ("/home", "dir", "root"), ("/home/dstrain", "dir", "dstrain"),
                     ("/home/dstrain/.ssh", "link", "dstrain", "/root/.ssh"))},
     ["dsc_train_user on host node1", "/home/dstrain/.ssh is a link to /root/.ssh"]),
    ({"var": "dsc_run_root", "path": "/srv/runs", "role": "theirs",
      "chain": chain(("/", "dir", "root"), ("/srv", "dir", "root"), ("/srv/runs", "dir", "alice"))},
     ["dsc_run_root on host node1", "it exists and is owned by alice, not dstrain", "Fix: point dsc_run_root"]),
    ({"var": "dsc_install_root", "path": "/opt/dscluster/ds_report.txt", "role": "user",
      "chain": chain(("/", "dir", "root"), ("/opt", "dir", "root"), ("/opt/dscluster", "dir", "dstrain"),
                     ("/opt/dscluster/ds_report.txt", "file", "alice"))},
     ["/opt/dscluster/ds_report.txt is owned by alice, not dstrain or root"]),
    ({"var": "root state", "path": "/var/lib/dscluster/packages", "role": "root",
      "chain": chain(("/", "dir", "root"), ("/var", "dir", "root"), ("/var/lib", "dir", "root"),
                     ("/var/lib/dscluster", "dir", "root"), ("/var/lib/dscluster/packages", "dir", "dstrain"))},
     ["root state on host node1: /var/lib/dscluster/packages is owned by dstrain, not root"]),
    ({"var": "dsc_install_root", "path": "/home/dstrain/dsc", "role": "made",
      "chain": chain(("/", "dir", "root"), ("/home", "dir", "root"), ("/home/dstrain", "dir", "dstrain"),
                     ("/home/dstrain/dsc", "missing", ""))},
     ["the directory above it, /home/dstrain, is owned by dstrain", "Fix: set dsc_install_root under"]),
    ({"var": "node helper", "path": "/usr/local/lib/dscluster", "role": "root",
      "chain": chain(("/", "dir", "root"), ("/usr", "dir", "root"), ("/usr/local", "dir", "root"),
                     ("/usr/local/lib", "dir", "root"), ("/usr/local/lib/dscluster", "dir", "dstrain"))},
     ["node helper on host node1", "/usr/local/lib/dscluster is owned by dstrain, not root", "chown root:root"]),
])
def test_a_link_or_a_foreign_owner_at_a_root_path_is_refused_naming_it(entry, needles):
    p, errors = plan_with_paths(root_paths(entry))
    assert p is None and len(errors) == 1, errors
    for needle in needles:
        assert needle in errors[0]
    assert "nothing was changed" in errors[0]


def test_a_root_owned_link_in_a_root_directory_is_the_systems_layout():
    p, errors = plan_with_paths([{"var": "dsc_install_root", "path": "/opt/dscluster", "role": "made",
                                  "chain": chain(("/", "dir", "root"), ("/opt", "link", "root", "var/opt"))}])
    assert errors == []


def test_the_data_dir_is_checked_at_launch_only_and_never_on_the_control_node_itself():
    data = {"var": "dsc_data_dir", "path": "/home/alice/data", "role": "user",
            "chain": chain(("/", "dir", "root"), ("/home", "dir", "root"), ("/home/alice", "dir", "alice"),
                           ("/home/alice/data", "dir", "alice"))}
    assert plan_with_paths(root_paths(data), dsc_data_dir="/home/alice/data")[1] == []
    _, errors = plan_with_paths(root_paths(data), full_run=True, dsc_data_dir="/home/alice/data")
    assert any("dsc_data_dir on host node1" in e and "owned by alice" in e for e in errors), errors
    # The one-node default: the node is the control node, its data dir the source, left alone.
    p, errors = plan_with_paths(root_paths(data), full_run=True, dsc_data_dir="/home/alice/data",
                                ansible_connection="local")
    assert not any("dsc_data_dir" in e for e in errors), errors


@pytest.mark.parametrize("var,path", [
    ("dsc_install_root", "/var/lib/dpkg"), ("dsc_install_root", "/var/lib/apt/lists"), ("dsc_install_root", "/var/cache/apt"),
    ("dsc_install_root", "/var/spool/cron"), ("dsc_install_root", "/snap"), ("dsc_install_root", "/opt/containerd"),
    ("dsc_run_root", "/var/lib/dpkg"),
])
def test_an_existing_directory_the_toolkit_did_not_make_is_refused_as_a_root(var, path):
    """A system subdirectory (dpkg's, whose maintainer scripts root runs at the next upgrade) as
    the install root or run root: it exists and is root's, so the toolkit did not make it (it
    makes its own the training user's), and provision would give it away. Refused before any
    change; a directory of the training user's, or one that does not exist yet, passes."""
    parts = path.split("/")[1:]
    links = [("/", "dir", "root")] + [("/" + "/".join(parts[:i + 1]), "dir", "root") for i in range(len(parts))]
    role = "made" if var == "dsc_install_root" else "theirs"
    p, errors = plan_with_paths(root_paths({"var": var, "path": path, "role": role, "chain": chain(*links)}))
    assert p is None and len(errors) == 1, errors
    assert f"{var} on host node1: root writes {path}, and it exists and is owned by root, not dstrain" in errors[0]
    assert "a system directory given to the training user" in errors[0] and "nothing was changed" in errors[0]
    theirs = links[:-1] + [(path, "dir", "dstrain")]
    assert plan_with_paths(root_paths({"var": var, "path": path, "role": role, "chain": chain(*theirs)}))[1] == []
    new = links[:-1] + [(path, "missing", "")]
    assert plan_with_paths(root_paths({"var": var, "path": path, "role": role, "chain": chain(*new)}))[1] == []


def test_an_existing_env_with_a_package_of_another_users_inside_is_refused():
    """What the probe found walking the env (dscnode.probe.foreign_inside): a site-packages/torch
    of another user's, which root's pip and every rank would import."""
    py = "/opt/torch/.venv/bin/python"
    torch = "/opt/torch/.venv/lib/python3.11/site-packages/torch"
    report = dict(owned(py), inside={"path": torch, "uid": 1002, "user": "alice", "why": "owned by another user"})
    p, errors = existing_plan([report, owned(py)])
    assert p is None and any(f"node1 is '{py}': {torch} is owned by another user (alice)" in e
                             and "Fix: make everything the env imports root's" in e for e in errors), errors
    # Not walked whole: nobody's to chown to; the fix says what to make of it instead.
    report = dict(owned(py), inside={"path": "/opt/torch/.venv", "why": "a tree of more than 400,000 entries, not all checked"})
    p, errors = existing_plan([report, owned(py)])
    assert p is None and any("/opt/torch/.venv is a tree of more than 400,000 entries, not all checked" in e
                             and "Fix: make it readable by root and the env no larger" in e and "chown" not in e
                             for e in errors), errors


def test_pip_into_an_env_of_roots_installs_from_roots_own_folder():
    """An existing env of root's with dsc_existing_install: the lock and the wheelhouse go to
    root's own folder (dscnode.ROOT_PACKAGES), written by root, never the training user's install
    root; the training user's own env installs from the install root as before."""
    py = "/opt/torch/.venv/bin/python"
    hostvars, groups, probes = cluster(2, dsc_env_manager="existing", dsc_existing_python=py,
                                       dsc_existing_install=True)
    for pr in probes.values():
        pr["existing_python"] = owned(py)
        pr["installed"] = {"lock": {}, "wheelhouse": "users-copy"}
        pr["installed_root"] = {"lock": {}, "wheelhouse": None}
    p, errors = dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS)
    assert errors == [] and p["env_owner"] == "root"
    assert (p["packages_dir"], p["packages_owner"]) == ("/var/lib/dscluster/packages", "root")
    assert p["node_wheelhouse"] == "/var/lib/dscluster/packages/wheelhouse"
    assert "TORCH_EXTENSIONS_DIR" not in p["pip_env"] and "TRITON_CACHE_DIR" not in p["pip_env"]
    p, errors = plan()
    assert errors == [] and (p["packages_dir"], p["packages_owner"]) == ("/opt/dscluster", "dstrain")


def test_a_dataset_to_sync_needs_rsync_on_every_node_it_goes_to(tmp_path):
    """launch syncs dsc_data_dir with rsync: a node whose probe found none is refused before any
    change, naming it and the fixes; a shared dataset, or a provision, does not need it there."""
    def planned(full_run, **settings):
        hostvars, groups, probes = cluster(2, dsc_data_dir=str(tmp_path), **settings)
        probes["node2"]["rsync"] = False
        return dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, {} if full_run else None,
                                 now="20261130-000000", full_run=full_run, check_dir=lambda p: True)
    p, errors = planned(True)
    assert p is None and errors == [
        "dsc_data_dir on host node2: launch syncs the dataset there with rsync, which node2 lacks. Fix: install "
        "rsync there (provision.yml does with dsc_manage_packages: true), or put the dataset where every node has "
        "it and set dsc_data_shared: true."], errors
    assert planned(True, dsc_data_shared=True)[1] == []
    p, errors = planned(False)
    assert errors == [] and [n["rsync"] for n in p["nodes"]] == [True, False]
