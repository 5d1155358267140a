"""The box as an appliance (issue 24's service part): `--version`, `serve --config FILE` (TOML,
a key per flag, flags win), `config --example`, the systemd unit (systemd-analyze verify) and
the notify protocol a `Type=notify` unit relies on: READY=1 once the model is loaded and the
ports listen, WATCHDOG=1 while the engine is alive, STOPPING=1 on SIGTERM."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest

from edgepaged.cli import _load_config, config_keys, serve
from edgepaged.client import SyncClient

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CLI = [str(BIN / "edgepaged")] if (BIN / "edgepaged").exists() else [sys.executable, "-m", "edgepaged.cli"]
ENV = {k: v for k, v in os.environ.items() if k not in ("EDGEPAGED_TOKEN", "EDGEPAGED_CONFIG", "NOTIFY_SOCKET",
                                                         "WATCHDOG_USEC", "WATCHDOG_PID")}


def test_version():
    r = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and re.fullmatch(r"edgepaged \d+\.\d+\.\d+\S*\n", r.stdout), r.stdout


def test_the_example_config_names_every_flag(tmp_path):
    import tomllib
    r = subprocess.run([*CLI, "config", "--example"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert tomllib.loads(r.stdout) == {}                      # all commented: the defaults
    keys = config_keys(serve)
    set_lines = [line[1:] for line in r.stdout.splitlines() if re.match(r"#[a-z_]+ = ", line)]
    assert {line.split(" = ")[0] for line in set_lines} == set(keys)   # every flag has its key, with a value
    every = tmp_path / "every.toml"
    every.write_text("\n".join(set_lines) + "\n")
    ctx = click.Context(serve)
    _load_config(ctx, str(every))                             # each key is taken
    assert set(ctx.default_map) == {o.name for o in keys.values()}
    assert ctx.default_map["model"] == ["llama3.2:3b"] and ctx.default_map["http_port"] == 7879

    bad = tmp_path / "bad.toml"
    bad.write_text('htp_port = 1\n')
    r = subprocess.run([*CLI, "serve", "--config", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown key 'htp_port'" in r.stderr and "http_port" in r.stderr, r.stderr
    bad.write_text('port = [\n')
    r = subprocess.run([*CLI, "serve", "--config", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "is not valid TOML" in r.stderr, r.stderr


def test_systemd_accepts_the_unit():
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze (Debian: apt-get install systemd; ./run.sh test installs it as root)")
    r = subprocess.run(["systemd-analyze", "verify", str(ROOT / "packaging" / "edgepaged.service")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    unit = (ROOT / "packaging" / "edgepaged.service").read_text()
    for line in ("Type=notify", "DynamicUser=yes", "StateDirectory=edgepaged", "CacheDirectory=edgepaged",
                 "ProtectSystem=strict", "ProtectHome=yes", "NoNewPrivileges=yes", "PrivateTmp=yes",
                 "Restart=on-failure", "WatchdogSec=", "RestrictAddressFamilies=", "#MemoryMax="):
        assert line in unit, line


def test_serve_from_a_config_file_tells_systemd_ready_watchdog_stopping(tmp_path):
    """A config file sets the server up and a flag overrides it; a NOTIFY_SOCKET of the test's own
    receives READY=1 after the banner, WATCHDOG=1 while it serves, STOPPING=1 on SIGTERM."""
    cfg = tmp_path / "edgepaged.toml"
    cfg.write_text('host = "127.0.0.1"\nport = 0\nhttp_port = 0\nno_mdns = true\nkv_memory = "2G"\n'
                   'grace = 1\nmax_tokens = 5\n')
    sock_path = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(sock_path)
    listener.settimeout(0.1)
    env = {**ENV, "NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "400000", "EDGEPAGED_VENV": sys.prefix}
    proc = subprocess.Popen([*CLI, "serve", "--config", str(cfg), "--max-tokens", "7"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    messages: list[tuple[float, str]] = []

    def drain(until: float):
        while time.monotonic() < until:
            try:
                messages.append((time.monotonic(), listener.recv(4096).decode()))
            except socket.timeout:
                pass
    try:
        banner = None
        for line in proc.stdout:
            if "ready on" in line:
                banner = line
                break
        assert banner is not None and "127.0.0.1:" in banner and "mDNS off" in banner, banner
        ready_seen_at = time.monotonic()
        address = re.search(r"ready on ([\d.]+:\d+)", banner).group(1)
        with SyncClient(address) as c:
            assert c.info["limits"]["max_tokens"] == 7              # the flag won over the file's 5
            assert c.info["context_length"] > 7
        import httpx
        http = re.search(r"HTTP \(OpenAI API, chat page\) (http://[\d.:]+)/", banner).group(1)
        health = httpx.get(http + "/health", timeout=10).json()
        mem = health["memory"]
        assert mem["kv_reserved_bytes"] > 1.9 * 2**30 and mem["kv_used_bytes"] == 0 and mem["weights_bytes"] > 0
        assert mem["rss_bytes"] < mem["kv_reserved_bytes"], mem     # the KV pool is committed as it fills
        assert "memory: weights" in banner and "reserved (committed as it fills)" in banner
        drain(time.monotonic() + 1.5)
        proc.send_signal(signal.SIGTERM)
        drain(time.monotonic() + 1.0)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()
    kinds = [m.split("\n")[0] for _, m in messages]
    assert kinds[0] == "READY=1" and messages[0][0] <= ready_seen_at + 1.0, messages
    assert "STATUS=serving SmolLM2-135M-Instruct.Q4_1" in messages[0][1]
    assert kinds.count("WATCHDOG=1") >= 4, kinds              # every 0.2 s for 1.5 s
    assert "STOPPING=1" in kinds and kinds.index("STOPPING=1") > kinds.index("READY=1")


# ---------------------------------------------------------------- the torch-free install

def test_the_wheel_serves_in_a_fresh_environment_without_torch(tmp_path):
    """`maturin build --release` gives an abi3 wheel (CPython >= 3.10); pip installs it with the
    model package into a new virtual environment, which then has no torch, triton or test
    tool; `edgepaged serve` from there answers "Paris" to `edgepaged ask`. Asking that
    environment for the torch runtime or a GPU says, in one line, what to install."""
    from edgepaged.testing.appliance import Served, build_wheel, dir_mb, runtime_venv
    wheel = build_wheel(tmp_path / "dist")
    assert "-cp310-abi3-" in wheel.name, wheel.name
    venv = tmp_path / "venv"
    py = runtime_venv(venv, wheel)
    r = subprocess.run([str(py), "-c", "import importlib.util as u; print([m for m in ('torch', 'triton', "
                        "'transformers', 'safetensors', 'pytest') if u.find_spec(m)])"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr
    size = dir_mb(venv)
    print(f"\nthe runtime's virtual environment: {size:.0f} MiB (the wheel {wheel.stat().st_size / 2**20:.1f} MiB, "
          f"the embedded model's package included)")
    assert size <= 300
    env = {k: v for k, v in ENV.items() if not k.startswith("EDGEPAGED_RUNTIME")}
    srv = Served(venv, env=env)
    try:
        assert any("numpy + Rust" in line for line in srv.lines), "".join(srv.lines)
        out = subprocess.run([str(venv / "bin" / "edgepaged"), "ask", "--server", srv.address,
                              "What is the capital of France?"], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0 and "Paris" in out.stdout, out.stdout + out.stderr
    finally:
        srv.stop()
    hf = tmp_path / "hf-folder"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    for flags, what in ((["--runtime", "torch"], "the torch runtime needs torch"),
                        (["--device", "cuda"], "--device cuda: the GPU path needs torch"),
                        # a safetensors folder runs on the CPU runtime without torch: this one's
                        # config names no architecture, and the error says so
                        (["--model", str(hf)], "unsupported model architecture")):
        r = subprocess.run([str(venv / "bin" / "edgepaged"), "serve", "--host", "127.0.0.1", "--port", "0",
                            "--http-port", "0", "--no-mdns", *flags], capture_output=True, text=True, timeout=60,
                           env=env)
        assert r.returncode != 0 and what in r.stderr, r.stderr
        assert ("pip install 'edgepaged[gpu]'" in r.stderr) == ("torch" in what), r.stderr
        assert "Traceback" not in r.stderr


def test_the_kv_pool_is_resident_only_where_it_was_touched():
    """The pool's first pages are faulted in ahead of the first request (KV_PREFAULT_TOKENS);
    in numpy's huge pages each layer's K and V came in 2 MB at a time, so the embedded
    model's 94 MB of prefault were 209 MB resident (the idle appliance 462 MB against its 400).
    In small pages what is resident is what was touched."""
    import re

    from edgepaged.model.cpu.runner import KV_PREFAULT_TOKENS, CpuRunner
    r = CpuRunner(num_blocks=4096)
    r.kv_prefault.join(60)
    kv = r.kv_cache
    start, end = kv.ctypes.data, kv.ctypes.data + kv.nbytes
    resident, region = 0, None
    for line in open("/proc/self/smaps"):
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            a, b = int(m.group(1), 16), int(m.group(2), 16)
            region = (a, b) if a < end and b > start else None
        elif region is not None and line.startswith("Rss:"):
            resident += int(line.split()[1]) * 1024
    touched = kv.shape[0] * 2 * (KV_PREFAULT_TOKENS // r.block_size) * kv.strides[2]
    assert touched <= resident <= touched * 1.1 + (4 << 20), (resident >> 20, touched >> 20)


def test_every_setting_is_one_field_and_the_settings_page_is_current():
    """serve's knobs are the fields of one typed object: each field a flag and a config key of
    the same name, read once (the runtime's knobs from the environment, a flag winning over
    them); docs/SETTINGS.md is `edgepaged config --table`, as generated now."""
    import dataclasses

    from edgepaged.model.settings import CpuConfig
    from edgepaged.server import settings
    fields = {f.name for f in settings.flag_fields()}
    assert fields == set(config_keys(serve)) | {"mdns_refresh"}          # (the one hidden flag: no key)
    assert {p.name for p in serve.params if p.expose_value} == fields
    s = settings.ServeSettings.read({}, env={})
    assert s == settings.ServeSettings() and s.cpu == CpuConfig()
    env = {"EDGEPAGED_QUANT_MATH": "exact", "EDGEPAGED_RUNTIME": "cpu", "EDGEPAGED_FUSED_MAX_TOKENS": "7"}
    s = settings.ServeSettings.read({"port": 1, "allowed_host": ["a.example"]}, env=env)
    assert (s.port, s.allowed_host, s.cpu.quant_math, s.cpu.runtime, s.cpu.fused_max_tokens) == \
        (1, ("a.example",), "exact", "cpu", 7)
    s = settings.ServeSettings.read({"quant_math": "int8", "runtime": "auto"}, env=env)
    assert (s.cpu.quant_math, s.cpu.runtime) == ("int8", "auto")          # the flag wins
    with pytest.raises(TypeError, match="nope"):
        settings.ServeSettings.read({"nope": 1}, env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.port = 2
    table = subprocess.run([*CLI, "config", "--table"], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0
    page = (ROOT / "docs" / "SETTINGS.md").read_text()
    assert page.endswith(table.stdout), "docs/SETTINGS.md is not `edgepaged config --table`: regenerate it"
    for f in settings.flag_fields():
        if not f.metadata["flag"].hidden:
            assert f"`{settings.flag_of(f)}` | `{f.name}`" in page
    # every EDGEPAGED_ variable the package reads has a row
    import edgepaged
    pkg = Path(edgepaged.__file__).parent
    read = set()
    for path in [*pkg.rglob("*.py"), *(pkg.parent / "rust_alloc").rglob("*.rs")]:
        read |= set(re.findall(r'"(EDGEPAGED_[A-Z0-9_]+)"', path.read_text()))
    assert {v for v in read if f"`{v}`" not in page} == set()


def test_the_kv_memory_is_bytes_or_auto():
    from edgepaged.cli import kv_budget
    assert kv_budget("auto") is None and kv_budget(None) is None and kv_budget("AUTO ") is None
    assert kv_budget("512M") == 512 << 20 and kv_budget("2G") == 2 << 30
    with pytest.raises(ValueError, match="not a size"):
        kv_budget("lots")
    r = subprocess.run([*CLI, "serve", "--kv-memory", "lots", "--host", "127.0.0.1", "--port", "0", "--http-port",
                        "0", "--no-mdns"], capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and "--kv-memory lots" in r.stderr, r.stderr
