"""What NCCL's RAS says of a stalled job (dscnode.ncclras): its reports as NCCL's documentation shows
them or as its printing code writes them (tests/fixtures/nccl/ras-*, README.md there), and ask
against a loopback server that speaks the client protocol as NCCL's rasClientEventLoop does."""
import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from dscnode import ncclras, stacks
from dscnode.rundir import RunDir

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nccl"


def read(name):
    return (FIXTURES / name).read_text()


def verdicts(name):
    return ncclras.behind(read(name))


@pytest.mark.parametrize("name", ["ras-running.txt", "ras-agree.json", "ras-h100.txt", "ras-h100.json"])
def test_ranks_that_agree_give_no_verdict(name):
    assert verdicts(name) == [] and ncclras.said([]) == []


@pytest.mark.parametrize("name", ["ras-behind.json", "ras-behind.txt"])
def test_one_rank_behind_is_named_with_its_count_and_the_others(name):
    """The same job state in JSON (NCCL 2.28.7 and later) and in text: the same verdict."""
    assert verdicts(name) == [{"kind": "behind", "comm": "0xae94423cfbb2ef4a", "op": "AllReduce", "count": 1234,
                               "others": 1235, "n_others": 1, "rank": 1, "host": "172.16.64.245", "pid": 1524345,
                               "gpu": "1"}]
    assert ncclras.said(verdicts(name)) == [
        "NCCL RAS: rank 1 (172.16.64.245, pid 1524345, GPU 1) has launched 1,234 AllReduce collectives on "
        "communicator 0xae94423cfbb2ef4a, the other 1,235: it is behind"]


def test_the_documented_mismatch_names_the_six_ranks_behind():
    """NCCL 2.24's one count for all kinds of collective: op None."""
    v = verdicts("ras-mismatch.txt")
    assert [(x["rank"], x["pid"], x["count"], x["others"], x["n_others"], x["op"]) for x in v] == [
        (r, 483072 + r, 6649, 6650, 26, None) for r in (0, 2, 3, 4, 5, 7)]
    assert ncclras.said(v)[1] == ("NCCL RAS: rank 2 (172.16.64.210, pid 483074, GPU 2) has launched 6,649 collectives "
                                  "on communicator 0x27a079b828ff1a75, the 26 others 6,650: it is behind")


def test_a_group_behind_that_ras_does_not_list_is_counted():
    """RAS lists a group's ranks only under half of the communicator: the documented mismatch with its
    rank lines taken out stands for a group it does not list."""
    text = "\n".join(line for line in read("ras-mismatch.txt").splitlines() if not line.startswith("  Rank"))
    v = ncclras.behind(text)
    assert [(x["rank"], x["ranks"], x["count"], x["others"]) for x in v] == [(None, 6, 6649, 6650)]
    assert ncclras.said(v)[0].startswith("NCCL RAS: 6 ranks have launched 6,649 collectives on communicator "
                                         "0x27a079b828ff1a75, the 26 others 6,650: they are behind")


def test_a_missing_rank_is_named():
    assert verdicts("ras-missing.json") == [{"kind": "missing", "comm": "0xae94423cfbb2ef4a", "rank": 1,
                                             "host": "172.16.64.245", "pid": 1524345, "gpu": "1"}]
    assert ncclras.said(verdicts("ras-missing.json")) == [
        "NCCL RAS: rank 1 (172.16.64.245, pid 1524345, GPU 1) of communicator 0xae94423cfbb2ef4a did not answer "
        "RAS (its process stopped or gone, or its node unreachable)"]


@pytest.mark.parametrize("name,kind", [("ras-incomplete.txt", "missing"), ("ras-dead.txt", "dead")])
def test_a_silent_process_and_its_rank_are_named_from_the_text(name, kind):
    v = verdicts(name)
    assert [(x["kind"], x["comm"], x["rank"], x["pid"], x["host"]) for x in v] == [
        (kind, None, None, 3487984, "172.16.64.213"), ("missing", "0xcf264af53edbe986", 21, None, None)]
    assert ncclras.said(v)[0].startswith("NCCL RAS: process 3487984 (172.16.64.213, GPU 5) ")
    assert ncclras.said(v)[1].startswith("NCCL RAS: rank 21 of communicator 0xcf264af53edbe986 did not answer RAS")


def test_ranks_of_another_status_are_no_verdict():
    """The documented teardown: RUNNING and FINALIZE ranks are still members, and RAS lists none of
    the 26 that left (UNKNOWN, NCCL 2.24 and 2.25)."""
    assert verdicts("ras-status.txt") == []


def test_an_error_and_a_rank_that_left_are_named():
    """ras-agree.json with rank 1's async_error set to 6 (ncclRemoteError), then moved to missing_ranks
    as a rank that answered (unresponsive false: it destroyed the communicator); and the text lines
    rasClientBreakDownErrors prints for the first (client_support.cc)."""
    doc = json.loads(read("ras-agree.json"))
    rank = doc["communicators"][0]["ranks"][1]
    rank["status"]["async_error"] = 6
    said = ("NCCL RAS: rank 1 (172.16.64.245, pid 1524345, GPU 1) reported Remote process error (asynchronous) on "
            "communicator 0xae94423cfbb2ef4a")
    assert ncclras.said(ncclras.behind(json.dumps(doc))) == [said]
    text = ("#0-0 (ae94423cfbb2ef4a) ERROR\n  Asynchronous error on 1 rank\n  Rank 1 reported Remote process error"
            " -- GPU 1 managed by process 1524345 on node 172.16.64.245\n")
    assert ncclras.said(ncclras.behind(text)) == [said]
    doc["communicators"][0]["ranks"].pop()
    doc["communicators"][0]["missing_ranks"] = [dict(rank, status={"unresponsive": False, "considered_dead": False})]
    assert ncclras.said(ncclras.behind(json.dumps(doc))) == [
        "NCCL RAS: rank 1 (172.16.64.245, pid 1524345, GPU 1) answered RAS but is not a member of communicator "
        "0xae94423cfbb2ef4a: it destroyed, aborted or finalized it, or has not joined it yet"]


@contextmanager
def ras(report, knows_json=True, hello=True):
    """A loopback RAS client socket for one connection, answering as rasClientEventLoop does
    (NVIDIA/nccl src/ras/client_support.cc): a line for each command line; STATUS and VERBOSE STATUS
    answered by report(conn, format), after which it closes the connection. knows_json=False: a server
    before NCCL 2.28.7, which knows no SET FORMAT; hello=False: one that never answers. Yields
    (port, the commands received, the serving thread)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)
    seen = []

    def run():
        try:
            with listener, listener.accept()[0] as conn:
                if not hello:
                    while conn.recv(1 << 16):
                        pass
                    return
                fmt = "text"
                for raw in conn.makefile("rb"):
                    cmd = raw.rstrip(b"\r\n").decode()
                    seen.append(cmd)
                    low = cmd.lower()
                    if low.startswith("client protocol "):
                        conn.sendall(b"SERVER PROTOCOL 2\n")
                    elif low.startswith("timeout ") and low[8:].isdigit():
                        conn.sendall(b"OK\n")
                    elif knows_json and low in ("set format json", "set format text"):
                        fmt = low[11:]
                        conn.sendall(b"OK\n")
                    elif low in ("status", "verbose status"):
                        report(conn, fmt)
                        return
                    else:
                        conn.sendall(b"ERROR: Unknown command %s\n" % cmd.encode())
        except OSError:  # the client closed its end: what ask does past its limit or timeout
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield listener.getsockname()[1], seen, thread
    thread.join(5)
    assert not thread.is_alive()  # ask closed the connection


def replay(name):
    """Sends the report in two parts, as NCCL does (its text's heading before it gathers the data)."""
    def report(conn, fmt):
        data = read(f"{name}.{'json' if fmt == 'json' else 'txt'}").encode()
        conn.sendall(data[:200])
        time.sleep(0.05)
        conn.sendall(data[200:])
    return report


def test_ask_gets_the_json_report_from_nccl_2_28_7_on():
    with ras(replay("ras-behind")) as (port, seen, _):
        answer = ncclras.ask(port=port, timeout=10)
    assert answer == read("ras-behind.json")
    assert seen == ["CLIENT PROTOCOL 2", "TIMEOUT 3", "SET FORMAT json", "VERBOSE STATUS"]
    assert ncclras.behind(answer)[0]["rank"] == 1


def test_ask_gets_the_text_report_before_nccl_2_28_7():
    with ras(replay("ras-behind"), knows_json=False) as (port, seen, _):
        answer = ncclras.ask(port=port, timeout=10)
    assert answer == read("ras-behind.txt") and seen[-1] == "VERBOSE STATUS"
    assert ncclras.behind(answer)[0]["rank"] == 1


def wait_for_close(conn, fmt):
    while conn.recv(1 << 16):
        pass


def trickle(conn, fmt):
    while True:
        conn.sendall(b"x")
        time.sleep(0.05)


def flood(conn, fmt):
    while True:
        conn.sendall(b"x" * (1 << 16))


@pytest.mark.parametrize("hello,report,what", [
    (False, None, "no handshake"),
    (True, wait_for_close, "no status report"),
    (True, trickle, "no status report"),  # bytes keep coming, never the end: the deadline is for it all
])
def test_ask_gives_up_within_its_timeout(hello, report, what):
    with ras(report, hello=hello) as (port, _, _):
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=what):
            ncclras.ask(port=port, timeout=0.5)
        assert time.monotonic() - start < 2


def test_ask_reads_no_more_than_its_limit():
    """An endless report: ask stops past limit bytes and closes the connection."""
    with ras(flood) as (port, _, _):
        with pytest.raises(ValueError, match="status report longer than 4096 bytes"):
            ncclras.ask(port=port, timeout=5, limit=4096)


def test_ask_says_where_nothing_listens_and_what_is_not_ras():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(OSError, match=f"NCCL RAS at 127.0.0.1:{port}: .*NCCL_RAS_ENABLE=0"):
        ncclras.ask(port=port, timeout=2)
    with socket.create_server(("127.0.0.1", 0)) as s:
        def http():
            conn = s.accept()[0]
            with conn:
                conn.recv(100)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        thread = threading.Thread(target=http, daemon=True)
        thread.start()
        with pytest.raises(ValueError, match="is not NCCL RAS: it answered 'HTTP/1.1 400 Bad Request'"):
            ncclras.ask(port=s.getsockname()[1], timeout=2)
        thread.join(5)


def test_a_stall_on_gpu_nodes_says_what_ras_says_first(tmp_path, capsys, monkeypatch):
    """The supervisor's stall on GPU nodes (stacks.at_stall with ras, here without py-spy): RAS's
    lines lead the summary in the log and in stalled.json; where nothing answers, it says so."""
    (tmp_path / RunDir.STALLED).write_text(json.dumps({"step": 40}) + "\n")
    with ras(replay("ras-behind")) as (port, _, _):
        lines = stacks.ras_lines(f"127.0.0.1:{port}")
    assert lines == ncclras.said(ncclras.behind(read("ras-behind.json"))) and "it is behind" in lines[0]
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    none = stacks.ras_lines(f"127.0.0.1:{closed}")
    assert len(none) == 1 and none[0].startswith(f"NCCL RAS: no answer at 127.0.0.1:{closed} (") \
        and none[0].endswith("NCCL_RAS_ENABLE=0, or its address elsewhere (NCCL_RAS_ADDR); the stacks alone")
    with ras(replay("ras-agree")) as (port, _, _):
        assert stacks.ras_lines(f"127.0.0.1:{port}") == [
            f"NCCL RAS (127.0.0.1:{port}): every rank has launched the same collectives"]
    monkeypatch.setenv("NCCL_RAS_ADDR", f"127.0.0.1:{closed}")  # as the ranks' environment names it
    assert stacks.at_stall(str(tmp_path), "r1", ["node1"], None, ras=True) == none
    assert json.loads((tmp_path / RunDir.STALLED).read_text())["stacks"] == none
    assert none[0] in capsys.readouterr().out
