"""`invoke facts --hosts localhost` on a real NVIDIA machine (an H200, run through the device
tool), kept as a fixture: what sparkprov reported must agree with the raw nvidia-smi output
captured in the same run, and say plainly that this is not a GB10."""

import json
import re
from pathlib import Path

from sparkprov.facts.hardware import parse_smi_header

H200 = Path(__file__).resolve().parents[1] / "fixtures" / "h200"


def test_recorded_facts_match_raw_nvidia_smi_of_the_same_run():
    report = json.loads((H200 / "invoke-facts-localhost.json").read_text())["localhost"]
    assert report["ok"] and report["errors"] == {} and report["remote_calls"] == 1
    gpu = report["facts"]["gpu"]
    table = (H200 / "nvidia-smi-device-run.txt").read_text()
    name, total, used, free, driver, cap, uuid, bus = [
        f.strip() for f in (H200 / "query-device-run.csv").read_text().strip().split(",")]
    header = re.search(r"Driver Version: (\S+)\s+CUDA Version: (\S+)", table)
    assert gpu["present"] is True
    assert gpu["driver_version"] == driver == header.group(1) == "580.159.04"
    assert gpu["cuda_version"] == header.group(2) == "13.0"
    [g] = gpu["gpus"]
    assert g["name"] == name == "NVIDIA H200" and g["name"] != "NVIDIA GB10"
    assert g["compute_cap"] == cap == "9.0"  # Hopper, not GB10's 12.1
    assert g["uuid"] == uuid and g["bus_id"] == bus
    assert f"{g['memory_total_mib']} MiB" == total  # a real number, unlike GB10's [N/A]
    assert parse_smi_header(table) == {"driver_version": driver, "cuda_version": "13.0"}


def test_recorded_host_identity_is_not_a_spark():
    facts = json.loads((H200 / "invoke-facts-localhost.json").read_text())["localhost"]["facts"]
    assert facts["host"]["arch"] == "x86_64"
    assert "dgx_name" not in facts["host"]
    assert facts["fabric"]["rails"] == []  # no ConnectX-7 twins on this machine
