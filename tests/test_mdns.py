"""Discovery end to end, inside a fresh network namespace (`unshare -n`, as root): tests never
advertise on the host's network. The scenario itself is tests/mdns_scenario.py."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgepaged.server.mdns import ServerRecord, advertising_interface, txt_properties

HERE = Path(__file__).resolve().parent


def namespace_problem() -> str | None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "`unshare` or `ip` is not installed"
    r = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot make a network namespace (needs root): {r.stderr.strip() or r.returncode}"
    return None


def test_ls_chat_and_goodbye_in_a_network_namespace():
    problem = namespace_problem()
    if problem:
        print(f"skipping the mDNS scenario: {problem}")
        pytest.skip(problem)
    cmd = f"ip link set lo up && exec {sys.executable} {HERE / 'mdns_scenario.py'}"
    r = subprocess.run(["unshare", "-n", "sh", "-c", cmd], capture_output=True, text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert r.stdout.rstrip().endswith("[mdns] ok")


def test_least_loaded_first():
    def rec(name, running, waiting, kv):
        return ServerRecord(name, ["10.0.0.1"], 7878, running=running, waiting=waiting, kv_usage=kv)
    records = [rec("busy", 3, 2, 0.5), rec("idle", 0, 0, 0.1), rec("full", 1, 0, 0.9), rec("fresh", 0, 0, 0.0)]
    assert [r.name for r in sorted(records, key=ServerRecord.load_key)] == ["fresh", "idle", "full", "busy"]


def test_txt_never_carries_the_token():
    props = txt_properties(version=1, model="m", context_length=8, auth=True)
    assert props["auth"] == "1" and set(props) == {"proto", "model", "ctx", "auth", "running", "waiting", "kv"}


def test_a_server_bound_to_one_address_is_announced_there_only():
    assert advertising_interface("127.0.0.1", None) == "127.0.0.1"    # loopback: never the local network
    assert advertising_interface("localhost", None) == "127.0.0.1"
    assert advertising_interface("0.0.0.0", None) is None              # every interface
    assert advertising_interface("", None) is None
    assert advertising_interface("127.0.0.1", "192.0.2.10") == "192.0.2.10"  # a named interface wins
