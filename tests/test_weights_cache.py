"""The weights cache (edgepaged/model/weights_cache.py): a large model's laid-out weights kept
on disk so a later load maps them instead of reading and re-laying the GGUF file. Real files,
the real loader and kernels; the size threshold set to 0 so tiny models take the path."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from edgepaged.model.cpu import runner as cpu_runtime
from edgepaged.model import weights_cache as wc
from edgepaged.model.settings import CpuConfig
from edgepaged.testing.decode import make_allocator, prompt_logits
from edgepaged.testing.gguf_models import write_random_gguf

# K-quants and Q4_0/Q8_0 (the exact math interleaves those), F16 kept as it is, a tied head
QTYPES = dict(token_embd=14, attn_q=12, attn_k=2, attn_v=14, attn_output=1, ffn_gate=12, ffn_up=8, ffn_down=2)
PROMPT = list(range(40, 72))
KEEP_FREE, KEEP_FREE_BYTES = wc.KEEP_FREE, wc.KEEP_FREE_BYTES     # the cache's own bound


@pytest.fixture(autouse=True)
def room(monkeypatch):
    """The cache keeps 10 % of the disk free (and 2 GiB): on a host with less, every write
    here would be refused by design. These tests' entries are a few hundred KB, so in this
    process the free share is 0 (the test of the bound sets its own)."""
    monkeypatch.setattr(wc, "KEEP_FREE", 0.0)
    monkeypatch.setattr(wc, "KEEP_FREE_BYTES", 0)


def disk_keeps_its_free_share(path) -> bool:
    import os
    st = os.statvfs(path)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return free >= max(KEEP_FREE * total, KEEP_FREE_BYTES) + (64 << 20)


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEPAGED_WEIGHTS_CACHE", str(tmp_path / "wc"))
    return write_random_gguf(tmp_path / "m.gguf", hidden=256, layers=2, heads=4, kv_heads=2, inter=512, tied=True,
                             qtypes=QTYPES)


def load(path, math="int8", wait=True):
    r = cpu_runtime.CpuRunner(path, num_blocks=16, kv_dtype="f32", progress=lambda *a, **k: None,
                              settings=CpuConfig(quant_math=math, weights_cache_min_bytes=0))
    if wait and r._cache_writer is not None:
        r._cache_writer.join()
    return r, np.asarray(prompt_logits(r, make_allocator(r), PROMPT, every=True))


def quant_weights(m):
    return [m.embed_q] + [s for lin in m.linears() for s in lin.segments]


def bases(a):
    while a is not None:
        yield a
        a = getattr(a, "base", None)


def entries(tmp_path):
    return sorted((tmp_path / "wc").glob("*" + wc.SUFFIX))


@pytest.mark.parametrize("math", ["int8", "exact"])
def test_a_second_load_maps_the_laid_out_weights_and_gives_the_same_logits(model, tmp_path, math):
    first, want = load(model, math)
    assert first.weights_cache == "writing" and len(entries(tmp_path)) == 1
    layouts = {s.layout for s in quant_weights(first.model)}
    assert layouts == ({"r16", "rows"} if math == "int8" else {"x8", "rows"})
    again, got = load(model, math)
    assert again.weights_cache == "hit"
    assert np.array_equal(got, want)             # bit for bit
    m = again.model
    assert {s.layout for s in quant_weights(m)} == layouts
    entry = str(entries(tmp_path)[0])
    for s in quant_weights(m):                   # every block weight views the entry, none the GGUF
        files = {str(b.filename) for b in bases(s.data) if isinstance(b, np.memmap) and b.filename}
        assert files == {entry}, s
    assert m.head.segments[0].data is m.embed_q.data        # the tied head is the embedding's array
    assert again.weight_bytes() == first.weight_bytes()
    from edgepaged.server.app import memory_line        # the banner says why the process looks small
    assert "mapped from the weights cache" in memory_line(again.memory())
    assert "mapped" not in memory_line(first.memory())


def test_the_same_file_loaded_twice_at_once_is_written_once(model, tmp_path, monkeypatch):
    import threading
    gate, real = threading.Event(), wc.write_entry
    monkeypatch.setattr(wc, "write_entry", lambda *a: (gate.wait(30), real(*a))[1])   # the first write still going
    a, _ = load(model, wait=False)
    b, _ = load(model, wait=False)
    assert a.weights_cache == b.weights_cache == "writing" and a._cache_writer is b._cache_writer
    gate.set()
    a._cache_writer.join()
    assert len(entries(tmp_path)) == 1 and list((tmp_path / "wc").glob("*.tmp")) == []


def test_a_changed_file_or_other_math_is_another_entry_and_the_stale_one_goes(model, tmp_path):
    load(model, "int8")
    old = entries(tmp_path)
    load(model, "exact")                          # another key: a second entry
    assert len(entries(tmp_path)) == 2
    st = model.stat()
    import os
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))    # the file "changed"
    r, _ = load(model, "int8")
    assert r.weights_cache == "writing"           # a miss: the identity is part of the key
    now = entries(tmp_path)
    assert len(now) == 1 and now[0] not in old    # both old entries were for the old file: swept
    assert load(model, "int8")[0].weights_cache == "hit"


def test_entries_of_another_build_are_dropped(model, tmp_path, monkeypatch):
    load(model, "int8")
    old = entries(tmp_path)
    monkeypatch.setattr(wc, "_build_id", "another build")     # an upgrade: the code that lays weights out changed
    r, _ = load(model, "int8")
    assert r.weights_cache == "writing"
    now = entries(tmp_path)
    assert len(now) == 1 and now[0] not in old


def test_a_truncated_or_garbled_entry_is_a_miss_never_wrong_weights(model, tmp_path, caplog):
    _, want = load(model)
    path = entries(tmp_path)[0]
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 4096)
    caplog.set_level(logging.INFO, "edgepaged.model")
    r, got = load(model)
    assert r.weights_cache == "writing" and np.array_equal(got, want)
    assert "does not match" in caplog.text and path.stat().st_size == size    # rewritten whole
    raw = b"[1, 2]"                                # the magic, then a header that is not an object
    path.write_bytes(wc.MAGIC + len(raw).to_bytes(8, "little") + raw)
    r, got = load(model)
    assert r.weights_cache == "writing" and np.array_equal(got, want)
    path.write_bytes(b"\0" * 64)                  # not an entry at all
    r, got = load(model)
    assert r.weights_cache == "writing" and np.array_equal(got, want)
    assert load(model)[0].weights_cache == "hit"


def test_an_entry_without_a_weight_the_model_has_is_dropped_and_the_file_loads(model, tmp_path, caplog):
    _, want = load(model)
    path = entries(tmp_path)[0]
    header = wc._read_header(path)
    del header["slots"]["1.down"]
    raw = json.dumps(header).encode()
    with open(path, "r+b") as f:                   # the same offsets: the header only shrank
        f.write(wc.MAGIC + len(raw).to_bytes(8, "little") + raw)
    r, got = load(model)
    assert r.weights_cache == "writing" and np.array_equal(got, want)
    assert "no weights for 1.down" in caplog.text
    assert load(model)[0].weights_cache == "hit"


def test_an_entry_whose_arrays_do_not_fit_the_model_is_dropped_and_the_file_loads(model, tmp_path, caplog):
    _, want = load(model)
    path = entries(tmp_path)[0]
    header = wc._read_header(path)
    header["arrays"][0]["shape"] = [1, header["arrays"][0]["nbytes"]]   # the right bytes, a wrong shape
    raw = json.dumps(header).encode()
    with open(path, "r+b") as f:
        f.write(wc.MAGIC + len(raw).to_bytes(8, "little") + raw)
    r, got = load(model)
    assert r.weights_cache == "writing" and np.array_equal(got, want)
    assert "loading from the file" in caplog.text


def test_turned_off_or_no_room_writes_nothing(model, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EDGEPAGED_WEIGHTS_CACHE", "0")
    assert load(model)[0].weights_cache == "off"
    assert not (tmp_path / "wc").exists()
    monkeypatch.setenv("EDGEPAGED_WEIGHTS_CACHE", str(tmp_path / "wc"))
    monkeypatch.setattr(wc, "KEEP_FREE_BYTES", 1 << 60)     # a disk that would fall below its free share
    r, _ = load(model)
    assert r.weights_cache == "writing"
    assert entries(tmp_path) == [] and list((tmp_path / "wc").glob("*.tmp")) == []
    assert "no room" in caplog.text


def test_a_cache_folder_that_cannot_be_made_loads_the_model_with_one_log_line(model, tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_bytes(b"")
    monkeypatch.setenv("EDGEPAGED_WEIGHTS_CACHE", str(tmp_path / "file" / "wc"))   # under a file: no folder
    r, got = load(model)
    assert r.weights_cache == "writing" and got.shape == (len(PROMPT), r.config.vocab_size)
    assert "is not usable" in caplog.text


def test_small_files_are_not_cached_by_default(model, tmp_path):
    r = cpu_runtime.CpuRunner(model, num_blocks=16, progress=lambda *a, **k: None)
    assert r.weights_cache == "off" and not (tmp_path / "wc").exists()


def test_removing_the_model_from_the_store_drops_its_entry(tmp_path, monkeypatch):
    from edgepaged.box import store
    monkeypatch.setenv("EDGEPAGED_STORE", str(tmp_path / "store"))
    monkeypatch.delenv("EDGEPAGED_WEIGHTS_CACHE", raising=False)      # the default: the store's weights/
    src = write_random_gguf(tmp_path / "m.gguf", hidden=256, layers=2, heads=4, kv_heads=2, inter=512, qtypes=QTYPES)
    e = store.import_file(src, "tiny")
    r, _ = load(e.path)
    assert r.weights_cache == "writing"
    directory = store.store_dir() / "weights"
    assert len(list(directory.glob("*" + wc.SUFFIX))) == 1
    (directory / "x.999999999.tmp").write_bytes(b"torn")               # a dead writer's temporary
    store.remove("tiny")
    assert list(directory.iterdir()) == []


def test_prepare_lays_a_file_out_in_a_subprocess_and_says_off_for_what_it_cannot_load(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEPAGED_WEIGHTS_CACHE", str(tmp_path / "wc"))
    path = write_random_gguf(tmp_path / "m.gguf", hidden=256, layers=2, heads=4, kv_heads=2, inter=512, qtypes=QTYPES)
    assert wc.prepare(path) == "off"              # under the default 512 MiB: nothing written
    assert not (tmp_path / "wc").exists()
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 20)
    assert wc.prepare(tmp_path / "broken.gguf") == "off"


def test_pull_lays_a_large_model_out_so_its_first_serve_maps_it(model, tmp_path, monkeypatch):
    """`edgepaged pull FILE` of a file over the threshold leaves its layout in the cache (one
    line says so): the first load after it is a hit. Under the threshold, or with the cache
    off, pull lays nothing out and says nothing of it."""
    import os

    from test_store import cli
    if not disk_keeps_its_free_share(tmp_path):     # the CLI runs in a process of its own
        pytest.skip("this disk has under 10 % (or 2 GiB) free: the weights cache refuses to write there by "
                    "design; the test runs wherever the disk keeps that share free")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEPAGED_")}
    env.update(HOME=str(tmp_path / "home"), EDGEPAGED_STORE=str(tmp_path / "store"),
               EDGEPAGED_WEIGHTS_CACHE=str(tmp_path / "pulled"))
    small = cli(env, "pull", str(model), "--name", "small", "--json")
    assert small.returncode == 0, small.stderr
    assert "laying out" not in small.stderr and not (tmp_path / "pulled").exists()
    off = cli({**env, "EDGEPAGED_WEIGHTS_CACHE_MIN": "0", "EDGEPAGED_WEIGHTS_CACHE": "0"}, "pull", str(model),
              "--name", "off")
    assert off.returncode == 0 and "laying out" not in off.stderr, off.stderr
    r = cli({**env, "EDGEPAGED_WEIGHTS_CACHE_MIN": "0"}, "pull", str(model), "--name", "big", "--json")
    assert r.returncode == 0, r.stderr
    assert "laying out" in r.stderr and "laid out in" in r.stderr, r.stderr
    assert len(list((tmp_path / "pulled").glob("*.epw"))) == 1
    path = json.loads(r.stdout.strip().splitlines()[-1])["path"]
    monkeypatch.setenv("EDGEPAGED_WEIGHTS_CACHE", str(tmp_path / "pulled"))
    runner = cpu_runtime.CpuRunner(path, num_blocks=16, progress=lambda *a, **k: None,
                                   settings=CpuConfig.from_env({"EDGEPAGED_WEIGHTS_CACHE_MIN": "0"}))
    assert runner.weights_cache == "hit"
