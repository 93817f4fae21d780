"""A node's GPUs judged before a launch or a restart (preflight's "gpu health" rows): what
`nvidia-smi -q -x` says of each GPU, the NVLink links `nvidia-smi nvlink -s` lists, the Xid events
in the kernel log, and DCGM's quick diagnostic where DCGM is installed (preflight.yml only). Each
finding names its GPU and a fix; FAIL refuses the node before any rank starts, WARN does not.

Read as root, each tool's output bounded (procs.run_bounded) and under a timeout: a GPU that fell
off the bus can make nvidia-smi hang, and DCGM's longer levels hang in reported cases."""
import os
import re
import shutil
import time
import xml.etree.ElementTree as ET

from dscnode.procs import run_bounded, user_name

XML_LIMIT = 8 << 20  # nvidia-smi -q -x: ~40 KB a GPU
NVRM_LIMIT = 1 << 20  # the kernel log's NVIDIA driver lines kept, the newest
NVIDIA_SMI_S = 30
DCGM_S = 120

# NVIDIA's Xid catalog: the events that mean the GPU itself is faulty or must be reset, and those
# an application causes (its own bad memory access, a killed context), which only warn.
FATAL_XIDS = {
    48: "a double-bit ECC error", 61: "an internal micro-controller breakpoint",
    62: "an internal micro-controller halt", 63: "an ECC page retirement or row remapping event",
    64: "an ECC page retirement or row remapping that failed", 74: "an NVLink error",
    79: "the GPU fell off the bus", 92: "a high single-bit ECC error rate", 94: "a contained ECC error",
    95: "an uncontained ECC error", 119: "a GSP RPC timeout", 120: "a GSP error", 140: "an unrecovered ECC error",
}
APPLICATION_XIDS = {13: "a graphics engine exception", 31: "a GPU memory page fault",
                    43: "a GPU that stopped processing", 45: "a preemptive cleanup"}
XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]+:[0-9a-fA-F]+:[0-9a-fA-F]+)[^)]*\): (\d+),\s*(.*)")
DRIVER_LOADED = "NVRM: loading NVIDIA"
# A GPU the driver finds off the bus when it probes it: one message of three lines and no Xid,
# "NVRM: The NVIDIA GPU 0000:b3:00.0" / "NVRM: (PCI ID: 10de:26b5) installed in this system has" /
# "NVRM: fallen off the bus and is not responding to commands." (tests/fixtures/gpu/kernel-xid/)
PROBED_GPU = re.compile(r"NVRM: The NVIDIA GPU ([0-9a-fA-F]+:[0-9a-fA-F]+:[0-9a-fA-F]+\.?[0-7]?)")
FELL_OFF = "fallen off the bus and is not responding to commands"

# Clock event reasons (nvidia-smi <clocks_event_reasons>, <clocks_throttle_reasons> before driver
# 535): those the hardware imposes fail, the software's thermal or power cap warns; idle, the
# applications clock setting, sync boost and the display clock are normal.
THROTTLE_FAIL = {"hw_slowdown": "hardware slowdown (HW_SLOWDOWN: overheating or a power supply fault)",
                 "hw_thermal_slowdown": "hardware thermal slowdown (the GPU is too hot)",
                 "hw_power_brake_slowdown": "hardware power brake (an external power brake signal)"}
THROTTLE_WARN = {"sw_thermal_slowdown": "software thermal slowdown (the GPU runs near its temperature limit)",
                 "sw_power_cap": "software power cap (the GPU draws its power limit)"}


# Uncorrectable ECC counters: Ampere and later (DRAM, SRAM parity and SEC-DED), before (double bit).
UNCORRECTABLE = ("dram_uncorrectable", "sram_uncorrectable", "sram_uncorrectable_parity",
                 "sram_uncorrectable_secded", "double_bit/total")


def _text(el, path):
    """The text of el's element at path, stripped; "" where either is missing."""
    found = el.find(path) if el is not None else None
    return (found.text or "").strip() if found is not None else ""


def _count(el, path):
    """A counter's value; 0 for N/A (ECC off, or a counter this GPU does not have)."""
    return _int(_text(el, path)) or 0


def _bus(bus_id):
    """(domain, bus, device) of a PCI address, as nvidia-smi (00000000:3B:00.0) and the kernel's
    Xid lines (0000:3b:00) write it."""
    parts = bus_id.split(".")[0].split(":")
    return tuple(int(p, 16) for p in parts[-3:]) if len(parts) >= 3 else None


def parse_xml(text):
    """Each GPU nvidia-smi -q -x lists, as the judgement needs it."""
    root = ET.fromstring(text)
    out = []
    for g in root.findall("gpu"):
        reasons = g.find("clocks_event_reasons")
        if reasons is None:
            reasons = g.find("clocks_throttle_reasons")
        active = sorted(re.sub(r"^clocks?_(event|throttle)_reasons?_", "", r.tag)
                        for r in (reasons if reasons is not None else []) if (r.text or "").strip() == "Active")
        link = g.find("pci/pci_gpu_link_info")
        util = _text(g, "utilization/gpu_util").split()[0:1]
        out.append({
            # nvidia-smi's index (dsc_gpus', CUDA_VISIBLE_DEVICES'): the XML lists the GPUs in its
            # order; minor_number is /dev/nvidiaN's, which may differ
            "index": len(out),
            "bus_id": g.get("id", ""), "name": _text(g, "product_name"),
            "util": int(util[0]) if util and util[0].isdigit() else None,
            "ecc_uncorrectable": {scope: sum(_count(g, f"ecc_errors/{scope}/{k}") for k in UNCORRECTABLE)
                                  for scope in ("volatile", "aggregate")},
            "remap": {"pending": _text(g, "remapped_rows/remapped_row_pending") == "Yes",
                      "failed": _text(g, "remapped_rows/remapped_row_failure") == "Yes"},
            "retired_pending": _text(g, "retired_pages/pending_retirement") == "Yes"
            or _text(g, "retired_pages/pending_blacklist") == "Yes",
            "pcie": {"width": _width(_text(link, "link_widths/current_link_width")),
                     "max_width": _width(_text(link, "link_widths/max_link_width")),
                     "gen": _int(_text(link, "pcie_gen/current_link_gen")),
                     # the link's own maximum: the lower of the device's and the host slot's
                     "max_gen": _int(_text(link, "pcie_gen/max_link_gen"))},
            "throttle": active,
            "processes": [{"pid": _int(_text(p, "pid")), "name": _text(p, "process_name"),
                           "used_mib": _int(_text(p, "used_memory").split(" ")[0])}
                          for p in g.findall("processes/process_info")],
        })
    return out


def _int(t):
    return int(t) if t and t.isdigit() else None


def _width(t):
    return _int(t.rstrip("x")) if t else None


def xids(log):
    """The Xid events since the NVIDIA driver last loaded (a reboot, or the module reloaded, is
    how a fatal one is cleared), each with its PCI address and text. A GPU found off the bus by the
    driver's probe counts as Xid 79 (probe: True); the driver probes before it prints its loading
    line, so such a GPU belongs to the load that follows it."""
    out, probed, gpu = [], [], None
    for line in log.splitlines():
        if DRIVER_LOADED in line:
            out, probed = probed, []
            continue
        m = XID.search(line)
        if m:
            out.append({"bus": _bus(m.group(1)), "code": int(m.group(2)), "text": m.group(3).strip()[:200]})
            continue
        m = PROBED_GPU.search(line)
        gpu = m.group(1) if m else gpu
        if gpu and FELL_OFF in line:
            e = {"bus": _bus(gpu), "code": 79, "probe": True,
                 "text": f"NVRM: The NVIDIA GPU {gpu} ... has {FELL_OFF}"}
            out.append(e)
            probed.append(e)
            gpu = None
    return out


def nvlinks(text):
    """{GPU index: (active links, inactive links)} from `nvidia-smi nvlink -s`."""
    out, gpu = {}, None
    for line in text.splitlines():
        m = re.match(r"^GPU (\d+):", line)
        if m:
            gpu = int(m.group(1))
            out[gpu] = [0, []]
            continue
        m = re.match(r"^\s+Link (\d+): (.*)$", line)
        if m and gpu is not None:
            if "inactive" in m.group(2).lower():
                out[gpu][1].append(int(m.group(1)))
            else:
                out[gpu][0] += 1
    return {g: (a, i) for g, (a, i) in out.items()}


def _owner(pid):
    try:
        return user_name(os.stat(f"/proc/{pid}").st_uid)
    except OSError:
        return "?"


def gpu_findings(g, links=None, owner=_owner, train_user=""):
    """(status, what, fix) of one GPU nvidia-smi listed, as if the run used it."""
    i, out = g["index"], []
    ecc = g["ecc_uncorrectable"]
    if ecc["volatile"]:
        out.append(("FAIL", f"GPU {i}: {ecc['volatile']} uncorrectable ECC errors since the driver loaded",
                    f"drain the node, reset the GPU (nvidia-smi -r -i {i}); if they return, replace it"))
    elif ecc["aggregate"]:
        out.append(("WARN", f"GPU {i}: {ecc['aggregate']} uncorrectable ECC errors in its lifetime, none since the driver loaded",
                    "watch it: a GPU that keeps having them belongs in a repair queue"))
    if g["remap"]["failed"]:
        out.append(("FAIL", f"GPU {i}: a row remapping failed (no spare rows left)", "replace the GPU (RMA)"))
    if g["remap"]["pending"] or g["retired_pending"]:
        out.append(("FAIL", f"GPU {i}: a memory row remapping or page retirement waits for a reset",
                    f"reset the GPU (nvidia-smi -r -i {i}) or reboot the node"))
    pcie = g["pcie"]
    if pcie["width"] and pcie["max_width"] and pcie["width"] < pcie["max_width"]:
        out.append(("FAIL", f"GPU {i}: PCIe link x{pcie['width']} of its x{pcie['max_width']}",
                    "reseat the GPU or its riser and check the slot: a trained-down link divides host transfers"))
    if pcie["gen"] and pcie["max_gen"] and pcie["gen"] < pcie["max_gen"] and (g["util"] or 0) >= 50:
        out.append(("WARN", f"GPU {i}: PCIe gen {pcie['gen']} of {pcie['max_gen']} at {g['util']} % load",
                    "check the slot's BIOS setting and the riser (idle GPUs lower the generation on purpose; this one is busy)"))
    for reason in g["throttle"]:
        if reason in THROTTLE_FAIL:
            out.append(("FAIL", f"GPU {i}: clocks held down by {THROTTLE_FAIL[reason]}",
                        "check the node's cooling, fans and power supplies (nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER)"))
        elif reason in THROTTLE_WARN:
            out.append(("WARN", f"GPU {i}: clocks held down by {THROTTLE_WARN[reason]}",
                        "check the airflow and the power limit (nvidia-smi -q -d TEMPERATURE,POWER)"))
    active, inactive = (links or {}).get(i, (0, []))
    if active and inactive:
        out.append(("FAIL", f"GPU {i}: NVLink links {', '.join(map(str, inactive))} down, {active} up",
                    "reset the GPU; a link that stays down needs the board or the NVSwitch tray looked at"))
    for p in g["processes"]:
        user = owner(p["pid"])
        if user != train_user:
            out.append(("WARN", f"GPU {i}: pid {p['pid']} ({p['name'] or '?'}, user {user}) holds {p['used_mib'] or '?'} MiB",
                        f"end it (kill {p['pid']}) or let the run use other GPUs (dsc_gpus)"))
    return out


def xid_finding(e, gpus, used):
    """A kernel log's Xid event as a finding: a fatal code on a GPU the run uses (or one nvidia-smi no
    longer lists) fails, any other warns."""
    g = next((g for g in gpus if _bus(g["bus_id"]) == e["bus"]), None)
    i = g["index"] if g else None
    where = f"GPU {i}" if g else "a GPU at PCI " + ":".join(f"{x:02x}" for x in e["bus"] or ())
    if e["code"] in FATAL_XIDS:
        what = f"{where}: Xid {e['code']}, {FATAL_XIDS[e['code']]}, since the driver loaded" if not e.get("probe") \
            else f"{where}: off the bus when the driver loaded (no Xid logged; judged as Xid 79)"
        return {"gpu": i, "status": "FAIL" if i is None or i in used else "WARN",
                "what": f"{what} ({e['text']})",
                "fix": "drain the node and reset or replace the GPU; the kernel log keeps the Xid until "
                       "the node reboots or the NVIDIA driver reloads"}
    return {"gpu": i, "status": "WARN",
            "what": f"{where}: Xid {e['code']}, {APPLICATION_XIDS.get(e['code'], 'not a hardware fault by itself')} ({e['text']})",
            "fix": "usually the program's own fault: look at the run that held the GPU then"}


def judge(gpus, used, events=(), links=None, owner=_owner, train_user=""):
    """Findings ({gpu, status, what, fix}) for the GPUs nvidia-smi listed. `used`: the indices the
    run takes (dsc_gpus, else the first dsc_slots): a fault on another GPU only warns."""
    found = []
    listed = {g["index"] for g in gpus}
    for i in used:
        if i not in listed:
            found.append({"gpu": i, "status": "FAIL", "what": f"GPU {i} is not listed by nvidia-smi "
                          f"(it lists {sorted(listed) or 'none'}): off the bus, or lost to its driver",
                          "fix": "look at the kernel log (dmesg | grep -i xid), reseat or replace the GPU, reboot"})
    for g in gpus:
        taken = g["index"] in used
        for status, what, fix in gpu_findings(g, links, owner, train_user):
            found.append({"gpu": g["index"], "status": status if taken else "WARN",
                          "what": what if taken else what + " (not used by this run)", "fix": fix})
    return found + [xid_finding(e, gpus, used) for e in events]


def kernel_log():
    """The kernel log's NVIDIA driver lines (dmesg, else journalctl's of this boot), the newest
    NVRM_LIMIT bytes of them; None where neither could be read (journalctl without access to the
    journal answers "-- No entries --", exit 0)."""
    for cmd in (["dmesg"], ["journalctl", "-k", "-b", "--no-pager", "-o", "short-monotonic"]):
        rc, out = run_bounded(cmd, NVRM_LIMIT, timeout=NVIDIA_SMI_S,
                              keep=lambda line: b"NVRM" in line or line.startswith(b"-- No entries"))
        if rc == 0 and not out.startswith("-- No entries"):
            return out
    return None


def dcgm_diag():
    """DCGM's quick diagnostic (level 1) where dcgmi is installed: None where it is not, else
    (status, what it said): FAIL for a test that failed or no answer in DCGM_S, WARN where dcgmi
    could not reach its host engine (nv-hostengine not running)."""
    if not shutil.which("dcgmi"):
        return None
    rc, out = run_bounded(["dcgmi", "diag", "-r", "1"], XML_LIMIT, timeout=DCGM_S)
    if rc == 124:
        return "FAIL", f"dcgmi diag -r 1 did not end within {DCGM_S} s"
    if re.search(r"host engine|Unable to connect", out, re.I):
        return "WARN", f"dcgmi could not reach DCGM's host engine ({' '.join(out.split())[-200:]}): no diagnostic ran"
    # a table row's padding collapsed: "GPU Memory | Fail - All" (tests/fixtures/gpu/dcgm/)
    failed = [" ".join(line.strip(" |").split()) for line in out.splitlines() if re.search(r"\bFail", line)]
    if rc == 0 and not failed:
        return "PASS", ""
    return "FAIL", "; ".join(failed)[:300] or f"dcgmi diag -r 1 exit {rc}"


def report(used=None, train_user="", full=False):
    """This node's GPU health as preflight's check reports it: None where there is no nvidia-smi,
    or where the run uses no GPU here (used == []: a CPU node; used None: every GPU)."""
    if not shutil.which("nvidia-smi") or used == []:
        return None
    start = time.monotonic()
    rc, text = run_bounded(["nvidia-smi", "-q", "-x"], XML_LIMIT, timeout=NVIDIA_SMI_S)
    if rc != 0:
        why = f"did not end within {NVIDIA_SMI_S} s" if rc == 124 else f"wrote more than {XML_LIMIT:,} bytes" if rc is None \
            else f"exit {rc}: {text.strip()[-200:]}"
        return {"gpus": [], "seconds": round(time.monotonic() - start, 2),
                "findings": [{"gpu": None, "status": "FAIL", "what": f"nvidia-smi -q -x {why}",
                              "fix": "run nvidia-smi on the node; a GPU off the bus or a driver fault needs a reset or reboot"}]}
    try:
        gpus = parse_xml(text)
    except ET.ParseError as e:
        return {"gpus": [], "seconds": round(time.monotonic() - start, 2),
                "findings": [{"gpu": None, "status": "FAIL", "what": f"nvidia-smi -q -x wrote no readable XML ({e})",
                              "fix": "run nvidia-smi -q -x on the node and update the driver if it breaks"}]}
    _, links = run_bounded(["nvidia-smi", "nvlink", "-s"], XML_LIMIT, timeout=NVIDIA_SMI_S)
    log = kernel_log()
    found = judge(gpus, [g["index"] for g in gpus] if used is None else used, xids(log or ""),
                  nvlinks(links), train_user=train_user)
    if log is None:
        found.append({"gpu": None, "status": "WARN", "what": "the kernel log could not be read (dmesg, journalctl): Xids not judged",
                      "fix": "let root read the kernel log (kernel.dmesg_restrict, CAP_SYSLOG)"})
    if full:
        diag = dcgm_diag()
        if diag is not None and diag[0] != "PASS":
            found.append({"gpu": None, "status": diag[0], "what": f"DCGM's quick diagnostic: {diag[1]}",
                          "fix": "run dcgmi diag -r 1 on the node and follow what it names (systemctl start "
                                 "nvidia-dcgm where its host engine is not running)"})
    return {"gpus": [{k: g[k] for k in ("index", "name", "bus_id")} for g in gpus], "findings": found,
            "dcgm": None if not full else ("absent" if not shutil.which("dcgmi") else "ran"),
            "seconds": round(time.monotonic() - start, 2)}
