"""Which rank a stalled NCCL job waits for, as NCCL's RAS subsystem tells it, where every Python stack
sits in the same NCCL call and says nothing.

RAS (reliability, availability, serviceability; NCCL 2.24 and later, on unless NCCL_RAS_ENABLE=0) is a
thread in every NCCL process: the threads keep TCP connections to each other over the bootstrap
interface and, on a query, gather from every process the state of each of its communicators: per rank
its count of collectives launched per kind (Broadcast, Reduce, AllGather, ReduceScatter, AllReduce:
comm->seqNumber, raised as the host launches each one; point-to-point and CUDA-graph-captured ones are
not counted), its init state and asynchronous error. In a stall the counts stop, and the rank that has
not launched the collective the others wait in is one (or more) behind theirs. A process that does not
answer (stopped, crashed, its node unreachable) is missing, and dead after 60 s.

The client protocol (src/ras/client_support.cc, rasClientEventLoop; src/ras/client.cc, NCCL's ncclras):
lines of text over TCP to NCCL_RAS_ADDR, localhost:28028 by default (each NCCL process of a node binds it,
SO_REUSEPORT: whichever accepts answers for the whole job); commands are case-insensitive:
  "CLIENT PROTOCOL 2" -> "SERVER PROTOCOL 2" (2 from 2.24 to 2.30; the server ignores the client's number)
  "TIMEOUT <s>" -> "OK": how long RAS waits for a leg of its gathering (5 s by default, 0 for ever); it
      answers with what it has at most 5 s after that (RAS_COLLECTIVE_EXTRA_TIMEOUT_SEC)
  "SET FORMAT json" -> "OK" from NCCL 2.28.7 (the same protocol number), before "ERROR: Unknown command ..."
  "VERBOSE STATUS" -> the report, after which the server reads nothing more and closes the connection.
The JSON report (rasDumpCommsToJSON, jsonWrite*) is RAS's raw data, compared here: "communicators": [{
"hash", "size", "ranks": [{"rank", "host", "pid", "cuda_dev", "status": {"init_state", "async_error", ...},
"collective_counts": {"AllReduce": n, ...}}], "missing_ranks": [{"rank", "host", "pid", "status":
{"unresponsive", "considered_dead"}}]}]. The text report (rasClientRunComms; the only one before 2.28.7)
compares them itself: under Warnings, "#0-0 (<hash>) MISMATCH", "Communicator ranks have different
AllReduce operation counts" ("collective": one count of all kinds, before 2.26), then the ranks grouped
by count, most numerous first ("26 ranks have launched up to operation 6650"), a group's members listed
only where it is under half of the ranks (a verbose query) ("Rank 0 -- GPU 0 managed by process 483072
on node 172.16.64.210"; a group of one: "Rank 1 has launched up to operation 1234 -- GPU ..."); under
Errors, INCOMPLETE and DEAD ("Process 3487984 on node 172.16.64.213 managing GPU 5"), and a
communicator's missing ranks ("Rank 21 -- GPU ...", before 2.26 "The missing rank: 21") and errors.

A rank is its rank in that communicator (the global rank in the world's); a host is the IP address of
its bootstrap interface; a pid is the process's in its own PID namespace. RAS samples moving counters:
a running job shows a spread of one now and then; a stall shows the same rank behind query after query.

Read in NVIDIA/nccl at 5067397c2676d5aed50042fc39e5c8ee96eb0027 (2.30.7; the protocol is the same from
v2.24.3-1): src/ras/client.cc, src/ras/client_support.cc, src/ras/ras_internal.h, src/ras/collectives.cc,
src/plugin/profiler.cc (seqNumber); and https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/
troubleshooting/ras.html, whose samples are tests/fixtures/nccl/ras-*."""
import json
import re
import socket
import time

PORT = 28028
PROTOCOL = 2
EXTRA_S = 5  # RAS answers with what it has at most this long after its leg timeout
# ncclResult_t codes as RAS's text names them (ncclErrorToString); 0 is success, 7 in progress
ERRORS = {1: "Unhandled CUDA error", 2: "System error", 3: "Internal error", 4: "Invalid argument",
          5: "Invalid usage", 6: "Remote process error"}


def ask(addr="127.0.0.1", port=PORT, timeout=10.0, limit=1 << 20):
    """The VERBOSE STATUS report of the NCCL job whose RAS listens at addr:port: JSON where the server
    takes SET FORMAT json (NCCL 2.28.7 and later), else text. At most `limit` bytes read, all within
    `timeout` seconds (RAS is told to give up on silent processes in time to answer within it); raises
    OSError (TimeoutError past the timeout) or ValueError (not RAS, or a report over `limit` bytes)."""
    where = f"NCCL RAS at {addr}:{port}"
    try:
        sock = socket.create_connection((addr, port), timeout=timeout)
    except TimeoutError:
        raise TimeoutError(f"{where}: no connection within {timeout:g} s") from None
    except OSError as e:
        raise _oserror(e, f"{where}: {e.strerror or e} (no NCCL >= 2.24 process there, "
                          "NCCL_RAS_ENABLE=0, or another NCCL_RAS_ADDR)") from e
    with sock:
        talk = _Talk(sock, where, timeout, limit)
        hello = talk.line(b"CLIENT PROTOCOL %d\n" % PROTOCOL, "handshake")
        if not re.fullmatch(r"SERVER PROTOCOL \d+", hello, re.I):
            raise ValueError(f"{where} is not NCCL RAS: it answered {hello[:80]!r}")
        leg = max(1, int(timeout) - EXTRA_S - 2)
        if (ok := talk.line(b"TIMEOUT %d\n" % leg, "answer to TIMEOUT")).upper() != "OK":
            raise ValueError(f"{where} refused TIMEOUT {leg}: {ok[:80]!r}")
        fmt = talk.line(b"SET FORMAT json\n", "answer to SET FORMAT")
        if fmt.upper() != "OK" and not fmt.startswith("ERROR"):
            raise ValueError(f"{where} answered SET FORMAT with {fmt[:80]!r}")
        answer = talk.rest(b"VERBOSE STATUS\n", "status report")
    if not answer.strip():
        raise ValueError(f"{where} closed the connection without a report")
    return answer


def _oserror(e, message):
    """An OSError of e's kind (ConnectionRefusedError...) saying `message`."""
    return OSError(e.errno, message) if e.errno else OSError(message)


class _Talk:
    """One connection to RAS: every write and read within one deadline, every read within one budget."""

    def __init__(self, sock, where, timeout, limit):
        self.sock, self.where, self.timeout, self.limit = sock, where, timeout, limit
        self.deadline, self.got, self.buf = time.monotonic() + timeout, 0, bytearray()

    def _io(self, what, act):
        left = self.deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            return act()
        except TimeoutError:
            raise TimeoutError(f"{self.where}: no {what} within {self.timeout:g} s") from None
        except OSError as e:
            raise _oserror(e, f"{self.where}, {what}: {e.strerror or e}") from e

    def _recv(self, what):
        data = self._io(what, lambda: self.sock.recv(min(1 << 16, self.limit + 1 - self.got)))
        self.got += len(data)
        if self.got > self.limit:
            raise ValueError(f"{self.where}: {what} longer than {self.limit} bytes")
        self.buf += data
        return data

    def line(self, command, what):
        """The server's one-line answer to `command`."""
        self._io(what, lambda: self.sock.sendall(command))
        while b"\n" not in self.buf:
            if not self._recv(what):
                raise ConnectionError(f"{self.where} closed the connection before its {what}")
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf[:] = rest
        return line.decode(errors="replace").strip()

    def rest(self, command, what):
        """All the server sends after `command`, up to its closing the connection."""
        self._io(what, lambda: self.sock.sendall(command))
        while self._recv(what):
            pass
        return self.buf.decode(errors="replace")


def behind(answer):
    """What a RAS report (ask's: JSON or text) says of its ranks, as dicts; [] when all agree.
    kind "behind": per communicator (comm: its hash, as NCCL's INFO lines print it) and kind of
    collective (op; None for text before 2.26, all kinds in one), a rank whose count is below the most
    advanced ranks' (count; others: theirs; n_others: how many); where RAS lists none of a group (it
    was half of the ranks or more) one dict with rank None and ranks: its size. Then "missing" (did not
    answer), "dead", "left" (answered without being a member: destroyed, finalized, or not yet joined)
    and "error" (error: what it reported). rank, host, pid, gpu: None where RAS does not say; a process
    RAS names outside any communicator has comm and rank None."""
    groups, out = (_json if answer.lstrip().startswith("{") else _text)(answer)
    top, reached = {}, {}
    for comm, op, count, n, _ in groups:
        top[comm, op] = max(top.get((comm, op), count), count)
        reached[comm, op, count] = reached.get((comm, op, count), 0) + n
    verdicts = []
    for comm, op, count, n, who in groups:
        most = top[comm, op]
        if count < most:
            same = dict(kind="behind", comm=comm, op=op, count=count, others=most, n_others=reached[comm, op, most])
            verdicts += [dict(same, **w) for w in who] or [dict(same, **_who(), ranks=n)]
    return verdicts + out


def _who(rank=None, host=None, pid=None, gpu=None):
    """A rank or process as a verdict names it."""
    return {"rank": rank, "host": host, "pid": pid, "gpu": gpu}


def _comm(h):
    """A communicator's hash as NCCL's INFO lines print it ("commId 0x..."): the text prints it 16 digits long."""
    return f"{int(h, 16):#x}" if h else None


def _json(answer):
    """(groups, verdicts) of a JSON report: a group per rank and kind of collective
    [comm, op, count, 1, [who]]; the missing ranks' and errors' verdicts."""
    groups, out = [], []
    for c in json.loads(answer).get("communicators") or []:
        comm = _comm(c.get("hash"))
        for r in c.get("ranks") or []:
            who = _rank(r)
            groups += [[comm, op, n, 1, [who]] for op, n in (r.get("collective_counts") or {}).items()]
            status = r.get("status") or {}
            for key, when in (("init_state", "initialization"), ("async_error", "asynchronous")):
                if status.get(key, 0) not in (0, 7):
                    out.append(dict(kind="error", comm=comm, error=f"{ERRORS.get(status[key], 'Unexpected error')} ({when})", **who))
        for r in c.get("missing_ranks") or []:
            status = r.get("status") or {}
            kind = "dead" if status.get("considered_dead") else "missing" if status.get("unresponsive") else "left"
            out.append(dict(kind=kind, comm=comm, **_rank(r)))
    return groups, out


def _rank(r):
    """A JSON rank's who: RAS writes host "unknown" and pid -1 where it found no process."""
    gpu = r.get("cuda_dev")
    gpu = None if gpu is None else str(gpu) if r.get("nvml_dev", gpu) == gpu else f"{gpu} (NVML {r['nvml_dev']})"
    host, pid = r.get("host"), r.get("pid")
    return _who(r.get("rank"), None if host in (None, "unknown") else host, None if pid in (None, -1) else pid, gpu)


HEAD = re.compile(r"#\d+-\d+ \(([0-9a-f]+)\) (INCOMPLETE|ERROR|MISMATCH)")
COUNTS = re.compile(r"  Communicator ranks have different (\w+) operation counts")
ERRORS_ON = re.compile(r"  (Initialization|Asynchronous) errors? on \d+ ranks?")
GROUP = re.compile(r"  (\d+) ranks have (?:launched up to operation (\d+)|not launched any operations)")
VALUE = re.compile(r"  \d+ ranks (?:have status|reported) (.+)")
RANK = re.compile(r"  Rank (\d+)(?: has launched up to operation (\d+)| has (not) launched any operations"
                  r"| (?:has status|reported) (.+?))?(?: -- (?:GPU (.+) managed by process (\d+) on node (\S+)"
                  r"|\[process information not found\]))?")
LISTED = re.compile(r"  The (missing|unknown) ranks?: ([\d,]+)")
PROCESS = re.compile(r"  Process (\d+) on node (\S+) managing GPUs? (.+)")


def _text(answer):
    """(groups, verdicts) of a text report: a group per count line [comm, op, count, n, [who listed]];
    the verdicts of the job's INCOMPLETE and DEAD lists and of a communicator's missing ranks, ranks of
    status NOCOMM (UNKNOWN before 2.26) and ranks that reported an error."""
    groups, out = [], []
    section = comm = topic = op = when = value = None
    for line in answer.splitlines():
        line = line.rstrip()
        if m := HEAD.fullmatch(line):
            section, comm, topic, value = None, _comm(m[1]), m[2], None
        elif line and not line.startswith(" "):  # the job's INCOMPLETE or DEAD, or another heading
            section, comm, topic = line, None, None
        elif m := COUNTS.fullmatch(line):
            topic, op = "count", None if m[1] == "collective" else m[1]
        elif line == "  Communicator ranks have different status":
            topic, value = "status", None
        elif m := ERRORS_ON.fullmatch(line):
            topic, when, value = "error", m[1].lower(), None
        elif (m := GROUP.fullmatch(line)) and topic == "count":
            groups.append([comm, op, int(m[2] or 0), int(m[1]), []])
        elif m := VALUE.fullmatch(line):
            value = m[1]
        elif (m := RANK.fullmatch(line)) and comm:
            who = _who(int(m[1]), m[7], m[6] and int(m[6]), m[5])
            if topic == "count" and (m[2] or m[3]):
                groups.append([comm, op, int(m[2] or 0), 1, [who]])
            elif topic == "count" and groups:
                groups[-1][4].append(who)
            elif topic == "INCOMPLETE":
                out.append(dict(kind="missing", comm=comm, **who))
            elif topic == "status" and (m[4] or value) in ("NOCOMM", "UNKNOWN"):
                out.append(dict(kind="left", comm=comm, **who))
            elif topic == "error":
                out.append(dict(kind="error", comm=comm, error=f"{m[4] or value} ({when})", **who))
        elif (m := LISTED.fullmatch(line)) and comm:
            kind = "missing" if m[1] == "missing" else "left"
            out += [dict(kind=kind, comm=comm, **_who(int(r))) for r in m[2].split(",") if r]
        elif (m := PROCESS.fullmatch(line)) and section in ("INCOMPLETE", "DEAD"):
            kind = "missing" if section == "INCOMPLETE" else "dead"
            out.append(dict(kind=kind, comm=None, **_who(None, m[2], int(m[1]), m[3])))
    return groups, out


def said(verdicts):
    """One line for each of behind's verdicts."""
    lines = []
    for v in verdicts:
        who, on = _said_who(v), f"communicator {v['comm']}"
        of = f" of {on}" if v["comm"] else ""
        if v["kind"] == "behind":
            ops = f"{v['op']} collectives" if v["op"] else "collectives"
            others = f"the other {v['others']:,}" if v["n_others"] == 1 else f"the {v['n_others']} others {v['others']:,}"
            if v["rank"] is None:
                lines.append(f"NCCL RAS: {v['ranks']} ranks have launched {v['count']:,} {ops} on {on}, {others}: "
                             "they are behind (RAS lists the ranks of a group under half the communicator only)")
            else:
                lines.append(f"NCCL RAS: {who} has launched {v['count']:,} {ops} on {on}, {others}: it is behind")
        elif v["kind"] == "missing":
            lines.append(f"NCCL RAS: {who}{of} did not answer RAS (its process stopped or gone, or its node unreachable)")
        elif v["kind"] == "dead":
            lines.append(f"NCCL RAS: {who}{of} is considered dead: RAS has not reached its process for 60 s")
        elif v["kind"] == "left":
            lines.append(f"NCCL RAS: {who} answered RAS but is not a member of {on}: "
                         "it destroyed, aborted or finalized it, or has not joined it yet")
        else:
            lines.append(f"NCCL RAS: {who} reported {v['error']}{' on ' + on if v['comm'] else ''}")
    return lines


def _said_who(v):
    """"rank 3 (172.16.64.210, pid 483075, GPU 3)"; outside a communicator "process 3487984 (172.16.64.213, GPU 5)"."""
    if v["rank"] is not None:
        name, about = f"rank {v['rank']}", (v["host"], v["pid"] and f"pid {v['pid']}", v["gpu"] and f"GPU {v['gpu']}")
    else:
        name, about = f"process {v['pid']}", (v["host"], v["gpu"] and f"GPU {v['gpu']}")
    about = ", ".join(x for x in about if x)
    return f"{name} ({about})" if about else name
