"""The GPU gate's judgement (dscnode.gpuhealth) on nvidia-smi's XML, each fault one edit of a
real H100's capture made a node of two GPUs (two_gpus), on kernel-log Xid lines users posted (tests/fixtures/gpu/kernel-xid/),
on dcgmi diag's output as posted (tests/fixtures/gpu/dcgm/), and preflight's rows."""
import time
from pathlib import Path

import pytest

from dscnode import gpuhealth
from dscnode.supervisor import describe, gpu_gate
from plugins.filter import preflight

# nvidia-smi -q -x on one H100 80GB HBM3 (driver 580.159.04), as bench/gpu_capture.sh took it
CAPTURE = (Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "h100-capture.xml").read_text()


def two_gpus(capture):
    """The capture made a node of two GPUs, edited here and nowhere else: its GPU as GPU 0 at PCI
    00000000:18:00.0 (the capture's virtual machine put it at 00:06.0) and a copy as GPU 1 at
    00000000:2A:00.0 (minor number 1, its own uuid), idling at PCIe gen 1 as idle GPUs drop to."""
    start, end = capture.index("\t<gpu id="), capture.index("</gpu>") + len("</gpu>")
    gpu = capture[start:end].replace("00000000:00:06.0", "00000000:18:00.0")
    second = (gpu.replace("00000000:18:00.0", "00000000:2A:00.0")
              .replace("<minor_number>0</minor_number>", "<minor_number>1</minor_number>")
              .replace("GPU-4c29180c-0c34-3a94-d251-97d6f7845c8b", "GPU-4c29180c-0c34-3a94-d251-97d6f7845c8c")
              .replace("<current_link_gen>5</current_link_gen>", "<current_link_gen>1</current_link_gen>")
              .replace("<device_current_link_gen>5</device_current_link_gen>",
                       "<device_current_link_gen>1</device_current_link_gen>"))
    head = capture[:start].replace("<attached_gpus>1</attached_gpus>", "<attached_gpus>2</attached_gpus>")
    return head + gpu + "\n" + second + capture[end:]


XML = two_gpus(CAPTURE)
GPU0 = XML.index('<gpu id="00000000:18:00.0">')
GPU1 = XML.index('<gpu id="00000000:2A:00.0">')


def on_gpu0(old, new):
    """The file with `old` replaced by `new` in GPU 0's section only."""
    head, section, tail = XML[:GPU0], XML[GPU0:GPU1], XML[GPU1:]
    assert old in section, old
    return head + section.replace(old, new, 1) + tail


def judged(xml=XML, used=(0, 1), events=(), links=None, owner=lambda pid: "dstrain"):
    return gpuhealth.judge(gpuhealth.parse_xml(xml), list(used), events, links, owner=owner, train_user="dstrain")


def test_healthy_gpus_have_no_finding():
    gpus = gpuhealth.parse_xml(XML)
    assert [(g["index"], g["bus_id"], g["name"]) for g in gpus] == [
        (0, "00000000:18:00.0", "NVIDIA H100 80GB HBM3"), (1, "00000000:2A:00.0", "NVIDIA H100 80GB HBM3")]
    # GPU 1 idles at PCIe gen 1 of 5, as idle GPUs do on purpose: no finding
    assert gpus[1]["pcie"] == {"width": 16, "max_width": 16, "gen": 1, "max_gen": 5}
    assert judged() == []


@pytest.mark.parametrize("old,new,status,needle", [
    ("<dram_uncorrectable>0</dram_uncorrectable>\n\t\t\t</volatile>",
     "<dram_uncorrectable>2</dram_uncorrectable>\n\t\t\t</volatile>", "FAIL",
     "GPU 0: 2 uncorrectable ECC errors since the driver loaded"),
    ("<dram_uncorrectable>0</dram_uncorrectable>\n\t\t\t\t<sram_threshold_exceeded>",
     "<dram_uncorrectable>1</dram_uncorrectable>\n\t\t\t\t<sram_threshold_exceeded>", "WARN",
     "GPU 0: 1 uncorrectable ECC errors in its lifetime"),
    ("<remapped_row_pending>No", "<remapped_row_pending>Yes", "FAIL", "waits for a reset"),
    ("<remapped_row_failure>No", "<remapped_row_failure>Yes", "FAIL", "a row remapping failed"),
    ("<current_link_width>16x", "<current_link_width>8x", "FAIL", "GPU 0: PCIe link x8 of its x16"),
    ("<clocks_event_reason_hw_slowdown>Not Active", "<clocks_event_reason_hw_slowdown>Active", "FAIL",
     "clocks held down by hardware slowdown"),
    ("<clocks_event_reason_hw_thermal_slowdown>Not Active", "<clocks_event_reason_hw_thermal_slowdown>Active",
     "FAIL", "hardware thermal slowdown"),
    ("<clocks_event_reason_hw_power_brake_slowdown>Not Active",
     "<clocks_event_reason_hw_power_brake_slowdown>Active", "FAIL", "hardware power brake"),
    ("<clocks_event_reason_sw_thermal_slowdown>Not Active", "<clocks_event_reason_sw_thermal_slowdown>Active",
     "WARN", "software thermal slowdown"),
    # under load, a generation below the link's maximum is a fault
    ("<current_link_gen>5</current_link_gen>\n\t\t\t\t\t<device_current_link_gen>5",
     "<current_link_gen>3</current_link_gen>\n\t\t\t\t\t<device_current_link_gen>3", None, None),
])
def test_each_fault_is_named_with_its_gpu_and_a_fix(old, new, status, needle):
    found = judged(on_gpu0(old, new))
    if status is None:  # gen 3 of 5 while idle: normal
        assert found == []
        busy = on_gpu0(old, new).replace("<gpu_util>0 %</gpu_util>", "<gpu_util>97 %</gpu_util>", 1)
        found = judged(busy)
        status, needle = "WARN", "GPU 0: PCIe gen 3 of 5 at 97 % load"
    assert [(f["gpu"], f["status"]) for f in found] == [(0, status)], found
    assert needle in found[0]["what"] and found[0]["fix"]


def test_a_fault_on_a_gpu_the_run_does_not_use_only_warns():
    found = judged(on_gpu0("<remapped_row_pending>No", "<remapped_row_pending>Yes"), used=[1])
    assert [(f["gpu"], f["status"]) for f in found] == [(0, "WARN")]
    assert found[0]["what"].endswith("(not used by this run)")


def test_the_older_throttle_reasons_element_is_read_too():
    older = on_gpu0("<clocks_event_reason_hw_slowdown>Not Active</clocks_event_reason_hw_slowdown>",
                    "<clocks_throttle_reason_hw_slowdown>Active</clocks_throttle_reason_hw_slowdown>")
    older = older.replace("clocks_event_reasons>", "clocks_throttle_reasons>", 2)
    assert [f["status"] for f in judged(older)] == ["FAIL"]


def test_a_gpu_the_run_uses_that_nvidia_smi_no_longer_lists_fails():
    one = XML[:GPU1] + XML[XML.index("</gpu>", GPU1) + len("</gpu>"):]
    found = judged(one)
    assert [(f["gpu"], f["status"]) for f in found] == [(1, "FAIL")]
    assert "GPU 1 is not listed by nvidia-smi (it lists [0])" in found[0]["what"]


def test_another_users_process_holding_gpu_memory_warns():
    proc = ("<processes>\n\t\t\t<process_info>\n\t\t\t\t<gpu_instance_id>N/A</gpu_instance_id>\n"
            "\t\t\t\t<pid>4242</pid>\n\t\t\t\t<type>C</type>\n\t\t\t\t<process_name>python3</process_name>\n"
            "\t\t\t\t<used_memory>70310 MiB</used_memory>\n\t\t\t</process_info>\n\t\t</processes>")
    xml = on_gpu0("<processes>\n\t\t</processes>", proc)
    assert judged(xml) == []  # the training user's own
    found = judged(xml, owner=lambda pid: "alice")
    assert [(f["gpu"], f["status"]) for f in found] == [(0, "WARN")]
    assert "pid 4242 (python3, user alice) holds 70310 MiB" in found[0]["what"]


# Kernel logs with NVIDIA's Xid lines as users posted them (tests/fixtures/gpu/kernel-xid/, each
# file's first line its source): dmesg with monotonic or -T times, journalctl -k, no time at all.
def kernel_log(name):
    """A fixture's captured lines, its source line taken off."""
    text = (Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "kernel-xid" / name).read_text()
    assert text.startswith("# https://"), name
    return text.split("\n", 1)[1]


def test_xids_of_each_log_form_are_read_with_their_gpu_and_code():
    # dmesg, seconds since boot: an application's page fault (31), then the GPU's micro-controller
    # halted (62) and the driver cleaned up the channels (45)
    assert [(e["bus"], e["code"]) for e in gpuhealth.xids(kernel_log("xid31-62-45-dmesg.log"))] == \
        [((0, 0x0a, 0), 31), ((0, 0x0a, 0), 62)] + [((0, 0x0a, 0), 45)] * 3
    # journalctl -k: host and "kernel:" before the same text
    events = gpuhealth.xids(kernel_log("xid31-journalctl.log"))
    assert [(e["bus"], e["code"]) for e in events] == [((0, 0xc1, 0), 31)] * 2
    assert events[0]["text"].startswith("pid=12890, Ch 0000003b, intr 00000000. MMU Fault: ENGINE HOST0")
    # dmesg -T after the driver's loading line; a newer driver's Xid 79 without pid and name
    assert [(e["bus"], e["code"]) for e in gpuhealth.xids(kernel_log("xid79-dmesg-T.log"))] == [((0, 0xa1, 0), 79)]
    [e] = gpuhealth.xids(kernel_log("xid79-no-pid.log"))
    assert (e["bus"], e["code"], e["text"]) == ((0, 6, 0), 79, "GPU has fallen off the bus.")


def test_xids_since_the_driver_loaded_fatal_fail_application_ones_warn():
    # akash-network/support#244's node: Xids 43, 31 and 94 on PCI 00:05, 00:07 and 00:08. Its
    # addresses are not the XML fixture's GPUs, so this copy's 00:07 is edited to 18:00 (GPU 0) and
    # 00:08 to 2a:00 (GPU 1); nothing else in the lines is changed. 00:05 stays a GPU nvidia-smi
    # does not list.
    log = kernel_log("xid43-31-94-dmesg-T.log").replace("PCI:0000:00:07", "PCI:0000:18:00") \
        .replace("PCI:0000:00:08", "PCI:0000:2a:00")
    events = gpuhealth.xids(log)
    assert [(e["bus"], e["code"]) for e in events] == [((0, 0, 5), 43), ((0, 0, 5), 43), ((0, 0x18, 0), 31),
                                                      ((0, 0x2a, 0), 94)]
    found = judged(events=events)
    assert [(f["gpu"], f["status"]) for f in found] == [(None, "WARN"), (None, "WARN"), (0, "WARN"), (1, "FAIL")]
    assert found[0]["what"].startswith("a GPU at PCI 00:00:05: Xid 43, a GPU that stopped processing")
    assert "GPU 0: Xid 31, a GPU memory page fault (pid=2512125, name=python3.10" in found[2]["what"]
    assert "GPU 1: Xid 94, a contained ECC error, since the driver loaded (pid='<unknown>'" in found[3]["what"]
    # not a GPU this run uses: a fatal Xid only warns
    assert [f["status"] for f in judged(events=events, used=[0])] == ["WARN"] * 4


def test_a_driver_reload_clears_the_xids_before_it():
    # #209's Xid 79, then #244's log from its driver's loading line on (two nodes' logs joined
    # as one node's whose driver reloaded): only the later Xids count
    log = kernel_log("xid79-dmesg-T.log") + kernel_log("xid43-31-94-dmesg-T.log")
    assert [e["code"] for e in gpuhealth.xids(log)] == [43, 43, 31, 94]
    loaded = kernel_log("xid43-31-94-dmesg-T.log").splitlines()[0]
    assert gpuhealth.xids(kernel_log("xid79-dmesg-T.log") + loaded) == []


def test_an_xid_of_a_gpu_nvidia_smi_no_longer_lists_fails():
    # PCI a1:00 is none of the XML fixture's GPUs: the node's nvidia-smi no longer lists it
    found = judged(events=gpuhealth.xids(kernel_log("xid79-dmesg-T.log")))
    assert [(f["gpu"], f["status"]) for f in found] == [(None, "FAIL")]
    assert found[0]["what"].startswith("a GPU at PCI 00:a1:00: Xid 79, the GPU fell off the bus")
    found = judged(events=gpuhealth.xids(kernel_log("xid31-62-45-dmesg.log")))
    assert [(f["gpu"], f["status"]) for f in found] == [(None, "WARN"), (None, "FAIL")] + [(None, "WARN")] * 3
    assert found[1]["what"].startswith("a GPU at PCI 00:0a:00: Xid 62, an internal micro-controller halt")


def test_a_gpu_the_drivers_probe_found_off_the_bus_fails_without_an_xid():
    # dmesg: the message's three lines, then the driver's loading line (it probes the GPUs first):
    # the loading line that follows does not clear it. PCI b3:00 is none of the fixture's GPUs.
    [e] = gpuhealth.xids(kernel_log("fallen-off-bus-probe-dmesg.log"))
    assert (e["bus"], e["code"], e["probe"]) == ((0, 0xb3, 0), 79, True)
    found = judged(events=[e])
    assert [(f["gpu"], f["status"]) for f in found] == [(None, "FAIL")]
    assert found[0]["what"].startswith("a GPU at PCI 00:b3:00: off the bus when the driver loaded (no Xid logged")
    assert "NVRM: The NVIDIA GPU 0000:b3:00.0 ... has fallen off the bus" in found[0]["what"]
    # journalctl -k: the continuation lines without host or "kernel:"; its PCI 18:00.0 is the
    # fixture's GPU 0 as it was captured
    log = kernel_log("fallen-off-bus-probe-journalctl.log")
    assert [(e["bus"], e["code"]) for e in gpuhealth.xids(log)] == [((0, 0x18, 0), 79)]
    found = judged(events=gpuhealth.xids(log))
    assert [(f["gpu"], f["status"]) for f in found] == [(0, "FAIL")]
    assert found[0]["what"].startswith("GPU 0: off the bus when the driver loaded")
    # a later reload clears it as it clears an Xid
    loaded = kernel_log("fallen-off-bus-probe-dmesg.log").splitlines()[-1]
    assert gpuhealth.xids(kernel_log("fallen-off-bus-probe-dmesg.log") + "\n" + loaded) == []


NVLINK = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5a3f2b4c-0d1e-4f6a-8b7c-9d0e1f2a3b4c)
\t Link 0: 26.562 GB/s
\t Link 1: <inactive>
\t Link 2: 26.562 GB/s
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-6b4a3c5d-1e2f-4a7b-9c8d-0e1f2a3b4c5d)
\t Link 0: 26.562 GB/s
"""


def test_an_nvlink_link_down_beside_others_up_fails():
    links = gpuhealth.nvlinks(NVLINK)
    assert links == {0: (2, [1]), 1: (1, [])}
    found = judged(links=links)
    assert [(f["gpu"], f["status"]) for f in found] == [(0, "FAIL")]
    assert "NVLink links 1 down, 2 up" in found[0]["what"]
    # a PCIe card without NVLink: every link inactive is no fault
    assert judged(links={0: (0, [0, 1]), 1: (0, [])}) == []


def test_preflight_rows_a_pass_or_each_finding():
    healthy = {"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "bus_id": "x"}], "findings": [], "seconds": 0.4}
    [row] = preflight.gpu_health_rows("node2", healthy)
    assert (row["check"], row["node"], row["status"]) == ("gpu health", "node2", "PASS")
    assert "1 GPU (NVIDIA H100 80GB HBM3): no ECC" in row["detail"]
    faulty = dict(healthy, findings=judged(on_gpu0("<remapped_row_pending>No", "<remapped_row_pending>Yes"),
                                           links={1: (1, [2])}) + judged(events=gpuhealth.xids(kernel_log("xid79-dmesg-T.log"))))
    [row] = preflight.gpu_health_rows("node2", faulty)  # one row a node: its worst status, every finding
    assert row["status"] == "FAIL" and row["detail"].count("; ") == 2, row
    assert "GPU 0: a memory row remapping" in row["detail"] and "GPU 1: NVLink links 2 down" in row["detail"]
    assert "nvidia-smi -r -i 0" in row["fix"]
    assert preflight.gpu_health_rows("node2", None) == []  # no nvidia-smi there: nothing to judge


def _nvidia_smi(tmp_path, monkeypatch, body):
    """An nvidia-smi program on PATH (this machine has no GPU): what the report runs and bounds."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + body)
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_no_nvidia_smi_no_report(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpuhealth.report([0]) is None


def test_the_report_reads_nvidia_smi_and_judges_the_gpus_the_run_uses(tmp_path, monkeypatch):
    (tmp_path / "gpus.xml").write_text(on_gpu0("<remapped_row_pending>No", "<remapped_row_pending>Yes"))
    _nvidia_smi(tmp_path, monkeypatch, f'[ "$1" = "-q" ] && exec cat {tmp_path}/gpus.xml\nexit 0\n')
    r = gpuhealth.report([1])
    assert [g["index"] for g in r["gpus"]] == [0, 1] and r["seconds"] < 10
    assert [f["status"] for f in r["findings"] if f["gpu"] == 0] == ["WARN"]  # not a GPU this run uses
    assert [f["status"] for f in gpuhealth.report([0])["findings"] if f["gpu"] == 0] == ["FAIL"]


@pytest.mark.parametrize("body,needle", [
    ("sleep 30\n", "did not end within"),  # a GPU off the bus can hang it
    ("yes '<x>'\n", "wrote more than"),  # never read whole into root's memory
    ("echo 'Unable to determine the device handle for GPU0000:18:00.0: Unknown Error'; exit 15\n", "exit 15: Unable"),
    ("echo '<nvidia_smi_log><gpu'\n", "no readable XML"),
])
def test_an_nvidia_smi_that_hangs_floods_or_fails_is_a_fail_not_a_hang(tmp_path, monkeypatch, body, needle):
    _nvidia_smi(tmp_path, monkeypatch, body)
    monkeypatch.setattr(gpuhealth, "NVIDIA_SMI_S", 1)
    monkeypatch.setattr(gpuhealth, "XML_LIMIT", 1 << 16)
    r = gpuhealth.report([0])
    assert [f["status"] for f in r["findings"]] == ["FAIL"] and needle in r["findings"][0]["what"], r


def test_the_supervisors_gate_names_each_failing_gpu_of_its_own_node(tmp_path, monkeypatch):
    assert gpu_gate(["node1"], {"node1": []}) == []  # CPU ranks: nothing asked
    (tmp_path / "gpus.xml").write_text(on_gpu0("<current_link_width>16x", "<current_link_width>4x"))
    _nvidia_smi(tmp_path, monkeypatch, f'[ "$1" = "-q" ] && exec cat {tmp_path}/gpus.xml\nexit 0\n')
    assert gpu_gate(["node1"], {"node1": [1]}) == []
    refused = gpu_gate(["node1"], {"node1": [0, 1]})
    assert refused == ["node1 GPU 0: PCIe link x4 of its x16"]
    assert describe({"kind": "gpu_health", "node": "node1", "findings": refused}) == \
        "the GPU gate refused the restart: node1 GPU 0: PCIe link x4 of its x16"


# dcgmi diag as NVIDIA's DCGM printed it in public posts (tests/fixtures/gpu/dcgm/, each file's first
# line its source). The posts show no exit status: the fake takes DCGM's own (dcgmi's main returns the
# dcgmReturn_t: 0 passed, -30 DCGM_ST_NVVS_ERROR a test failed, -21 no host engine; the shell sees it
# modulo 256).
DCGM_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "dcgm"


def _dcgmi(tmp_path, monkeypatch, body):
    """A dcgmi program on PATH (no DCGM here), beside _nvidia_smi's where a test made one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "dcgmi").write_text("#!/bin/sh\n" + body)
    (bin_dir / "dcgmi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def _dcgmi_replays(tmp_path, monkeypatch, fixture, rc):
    """dcgmi answering `dcgmi diag -r 1` with a fixture's output (its source line left out)."""
    _dcgmi(tmp_path, monkeypatch, f'[ "$*" = "diag -r 1" ] || exit 64\n'
                                  f'tail -n +2 {DCGM_FIXTURES / fixture}\nexit {rc}\n')


@pytest.mark.parametrize("fixture,rc,status,needle", [
    ("pass-3.3.3-r2.txt", 0, "PASS", ""),  # the table DCGM 3.x prints: "Pass - All" a test
    ("pass-4.4.2-r2.txt", 0, "PASS", ""),  # DCGM 4.x's: a result a test, then one a GPU
    ("fail-3.3.8-r3-gpu-memory.txt", 226, "FAIL", "GPU Memory | Fail - All"),
    ("fail-4.2.3-r2-pcie.txt", 226, "FAIL", "pcie | Fail"),
    ("no-host-engine.txt", 235, "WARN", "Unable to connect to host engine. Host engine connection invalid"),
])
def test_dcgm_diag_judges_what_dcgmi_printed(tmp_path, monkeypatch, fixture, rc, status, needle):
    _dcgmi_replays(tmp_path, monkeypatch, fixture, rc)
    got, what = gpuhealth.dcgm_diag()
    assert got == status and needle in what, (got, what)
    if status == "PASS":
        assert what == ""
    if status == "FAIL":  # only the failed test: not a skipped one, not an Info or Warning text
        assert what.count("Fail") == 1 and "Skip" not in what and "Persistence" not in what, what


def test_a_dcgmi_that_hangs_is_a_fail_not_a_hang(tmp_path, monkeypatch):
    _dcgmi(tmp_path, monkeypatch, "sleep 30\n")  # DCGM's longer levels hang in reported cases
    monkeypatch.setattr(gpuhealth, "DCGM_S", 1)
    start = time.monotonic()
    assert gpuhealth.dcgm_diag() == ("FAIL", "dcgmi diag -r 1 did not end within 1 s")
    assert time.monotonic() - start < 10


def test_no_dcgmi_no_diagnostic(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpuhealth.dcgm_diag() is None


def test_the_full_report_carries_dcgms_finding_into_preflights_row(tmp_path, monkeypatch):
    (tmp_path / "gpus.xml").write_text(XML)
    _nvidia_smi(tmp_path, monkeypatch, f'[ "$1" = "-q" ] && exec cat {tmp_path}/gpus.xml\nexit 0\n')
    assert gpuhealth.report([0])["dcgm"] is None  # the supervisor's gate: no diagnostic
    assert gpuhealth.report([0], full=True)["dcgm"] == "absent"

    _dcgmi_replays(tmp_path, monkeypatch, "fail-3.3.8-r3-gpu-memory.txt", 226)
    r = gpuhealth.report([0], full=True)
    assert r["dcgm"] == "ran"
    [dcgm] = [f for f in r["findings"] if "DCGM" in f["what"]]
    assert dcgm["gpu"] is None and dcgm["status"] == "FAIL", dcgm
    assert dcgm["what"] == "DCGM's quick diagnostic: GPU Memory | Fail - All"
    [row] = preflight.gpu_health_rows("node2", r)
    assert row["status"] == "FAIL" and "DCGM's quick diagnostic: GPU Memory | Fail - All" in row["detail"]
    assert "dcgmi diag -r 1" in row["fix"]

    _dcgmi_replays(tmp_path, monkeypatch, "no-host-engine.txt", 235)
    [dcgm] = [f for f in gpuhealth.report([0], full=True)["findings"] if "DCGM" in f["what"]]
    assert dcgm["status"] == "WARN" and "systemctl start nvidia-dcgm" in dcgm["fix"], dcgm

    _dcgmi_replays(tmp_path, monkeypatch, "pass-4.4.2-r2.txt", 0)
    r = gpuhealth.report([0], full=True)
    assert r["dcgm"] == "ran" and not [f for f in r["findings"] if "DCGM" in f["what"]], r
