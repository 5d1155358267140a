# Keep this block first. Triton reads TRITON_INTERPRET once, when it is first imported (torch can
# import it lazily too, e.g. through torch._inductor), so the variable must be set before any
# import below. By default the Triton kernels run in Triton's CPU interpreter; with
# EDGEPAGED_GPU_TESTS=1 they are compiled and run on the CUDA GPU instead.
import os

if os.environ.get("EDGEPAGED_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the clients never remember a server across tests (test_cli.py checks the cache itself)
os.environ["EDGEPAGED_SERVER_CACHE"] = "0"
# a pull by Ollama name never leaves the box in a test: the registry is a closed loopback port
# unless the test serves one of its own (edgepaged.testing.registry)
os.environ["EDGEPAGED_OLLAMA_REGISTRY"] = "http://127.0.0.1:9"
# and what a test's server stores (/api/pull, /api/create, /api/copy) goes to a folder of the session's
# (removed when the session ends: a run leaves nothing in /tmp)
if "EDGEPAGED_STORE" not in os.environ:
    import atexit
    import shutil
    import tempfile
    os.environ["EDGEPAGED_STORE"] = tempfile.mkdtemp(prefix="edgepaged-test-store-")
    atexit.register(shutil.rmtree, os.environ["EDGEPAGED_STORE"], ignore_errors=True)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random llama (safetensors + tokenizer.json) shared by the engine and server tests."""
    from edgepaged.testing.tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def embedded_runner():
    """The embedded SmolLM2-135M-Instruct on the CPU runtime (what `serve` runs on a CPU),
    loaded once per session, with a small KV pool (256 blocks of 16 tokens). Shared by the
    server tests: one engine at a time."""
    from edgepaged.model.cpu.runner import CpuRunner
    return CpuRunner(num_blocks=256)
