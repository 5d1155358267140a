"""The one-file MicroPython client (edgepaged/micro/), run under CPython against the real server:
its msgpack subset against the msgpack package, its imports against MicroPython's modules."""
import ast
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepaged.testing.serving import serving

MICRO = Path(__file__).resolve().parent.parent / "edgepaged" / "micro"
# what MicroPython offers (its built-in modules, u-prefixed aliases included) and nothing else
MICROPYTHON_MODULES = {"socket", "usocket", "struct", "ustruct", "sys", "usys", "time", "utime", "errno", "uerrno",
                       "gc", "micropython", "select", "uselect", "json", "ujson", "binascii", "ubinascii", "os",
                       "uos", "io", "uio", "collections", "ucollections", "math", "random", "urandom", "network",
                       "machine"}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def load_micro():
    spec = importlib.util.spec_from_file_location("edgepaged_micro", MICRO / "edgepaged_micro.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


micro = load_micro()


@pytest.mark.parametrize("name", ["edgepaged_micro.py", "hub_example.py"])
def test_imports_nothing_outside_micropython(name):
    tree = ast.parse((MICRO / name).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module != "__future__", ast.dump(node)
            imported.add(node.module.split(".")[0])
        # features MicroPython lacks or only partly has
        assert not isinstance(node, (ast.AnnAssign, ast.AsyncFunctionDef, ast.Await, ast.NamedExpr, ast.Match)), \
            f"{name}:{getattr(node, 'lineno', '?')}: {type(node).__name__}"
        assert not isinstance(node, ast.JoinedStr), f"{name}:{node.lineno}: f-strings are left out on small ports"
        if isinstance(node, (ast.FunctionDef,)):
            assert node.returns is None and all(a.annotation is None for a in node.args.args), node.name
    assert imported <= MICROPYTHON_MODULES | {"edgepaged_micro"}, imported - MICROPYTHON_MODULES


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=300)
    | st.binary(max_size=300),
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=20), inner, max_size=20),
    max_leaves=40)


@settings(max_examples=150, deadline=None)
@given(json_like)
def test_msgpack_subset_matches_the_msgpack_package(value):
    ours = bytes(micro.packb(value))
    assert msgpack.unpackb(ours, raw=False, strict_map_key=False) == value
    theirs = msgpack.packb(value, use_bin_type=True)
    assert micro.unpackb(theirs) == value
    assert micro.unpackb(memoryview(bytearray(theirs))) == value


def test_msgpack_edges():
    for n in (0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, -1, -32, -33, -128, -129,
              -32768, -32769, -2**31, -2**31 - 1, -2**63):
        assert bytes(micro.packb(n)) == msgpack.packb(n), n
    for size in (31, 32, 255, 256, 65535, 65536):
        s = "x" * size
        assert bytes(micro.packb(s)) == msgpack.packb(s)
        assert bytes(micro.packb([0] * size)) == msgpack.packb([0] * size)
    assert micro.unpackb(b"\xca\x3f\x80\x00\x00") == 1.0   # float32
    with pytest.raises(ValueError):
        micro.unpackb(msgpack.packb(msgpack.ExtType(1, b"x")))
    with pytest.raises(ValueError):
        micro.unpackb(b"\x01\x02")


async def test_the_micro_client_against_the_real_server(embedded_runner):
    async with serving(embedded_runner) as server:
        port = server.port

        def scenario():
            out = {}
            with micro.Client("127.0.0.1", port, name="kitchen-hub", max_frame=4096) as c:
                out["info"] = c.info
                out["answer"] = c.ask("What is the capital of France?", max_tokens=16)
                out["done"] = c.done
                pieces = []
                answer = c.chat([{"role": "user", "content": "Write a very long story about a dragon."}],
                                max_tokens=300, temperature=0)
                for text in answer:
                    pieces.append(text)
                    if len(pieces) == 3:
                        break
                answer.close()            # what a MicroPython caller does to stop early
                out["cancelled"] = c.done
                for _ in range(100):       # its blocks go back once the step using them ends
                    out["stats"] = c.stats()
                    if out["stats"]["kv_blocks_used"] == 0:
                        break
                    time.sleep(0.02)
                out["generated"] = "".join(c.generate("The capital of Italy is", max_tokens=4, temperature=0))
                out["generate_done"] = c.done
                small = micro.Client("127.0.0.1", port, max_frame=512)
                try:
                    small.stats()
                except micro.ServerError as e:
                    out["too_large"] = e.code
                out["after_too_large"] = small.ask("Say hi.", max_tokens=2)
                small.close()
            return out

        out = await trio.to_thread.run_sync(scenario)
        assert out["info"]["version"] == 1 and out["info"]["model"] == "SmolLM2-135M-Instruct.Q4_1"
        assert "Paris" in out["answer"] and out["done"]["finish_reason"] == "stop"
        assert out["cancelled"]["finish_reason"] == "cancelled"
        assert out["stats"]["kv_blocks_used"] == 0 and out["stats"]["finished"]["cancelled"] == 1
        assert out["generated"] and out["generate_done"]["usage"]["completion_tokens"] == 4
        assert out["too_large"] == "frame_too_large" and out["after_too_large"]


async def test_token_and_the_hub_example_as_a_script(embedded_runner):
    async with serving(embedded_runner, token="hub-secret") as server:
        def wrong():
            try:
                micro.Client("127.0.0.1", server.port, token="nope")
            except micro.ServerError as e:
                return e.code
        assert await trio.to_thread.run_sync(wrong) == "auth_failed"
        # -S -E -s: no site-packages at all, only the standard library and the script's folder
        r = await trio.run_process([sys.executable, "-S", "-E", "-s", str(MICRO / "hub_example.py"), "127.0.0.1",
                                    str(server.port), "hub-secret"], capture_stdout=True, capture_stderr=True,
                                   check=False)
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr.decode()
    assert "box says:" in out and "heating:" in out, out


def test_the_example_runs_without_site_packages_even_when_imported():
    r = subprocess.run([sys.executable, "-S", "-E", "-s", "-c", "import edgepaged_micro, hub_example; "
                        "print(hub_example.question(hub_example.READINGS))"], cwd=MICRO, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert "17.5 C" in r.stdout


def test_the_example_needs_an_address_and_says_a_failure_in_one_line():
    """No address written in: without one it prints its usage (exit 2); a box that is not
    there is one line from the client's own error (exit 1), no traceback."""
    import socket
    r = subprocess.run([sys.executable, "-S", "-E", "-s", "hub_example.py"], cwd=MICRO, capture_output=True, text=True)
    assert r.returncode == 2 and "usage: hub_example.py HOST" in r.stdout
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                      # a port nothing listens on
    r = subprocess.run([sys.executable, "-S", "-E", "-s", "hub_example.py", "127.0.0.1", str(port)], cwd=MICRO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout.startswith("hub: unreachable: cannot connect to 127.0.0.1")
    assert "Traceback" not in r.stderr + r.stdout
    assert "192.168" not in (MICRO / "hub_example.py").read_text()
