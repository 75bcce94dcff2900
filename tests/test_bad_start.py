"""Every bad start of ``aioengine serve`` (entrypoints/preflight.py and the
CLI around it): one line on stderr naming the problem, exit code 1, no
traceback, within 2 s, because it is found before anything heavy loads.

Each case runs ``python -m aioengine.entrypoints.cli serve ...`` as a user
would; the expected fragment of the message pins down which check caught it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from aioengine.config import default_model_path
from aioengine.entrypoints import preflight

REPO_ROOT = Path(__file__).resolve().parents[1]
BAD_START_LIMIT_S = 2.0


def write_gguf(path: Path, arch: str, tokenizer: bool = True) -> Path:
    """A tiny GGUF file with one tensor and the metadata keys the checks read."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_embedding_length(8)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
    w.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def head_of_default_model(path: Path, num_bytes: int) -> Path:
    with open(default_model_path(), "rb") as src:
        path.write_bytes(src.read(num_bytes))
    return path


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# (id, flags given tmp_path, expected fragment of the message)
Flags = Callable[[Path], list[str]]
CASES: list[tuple[str, Flags, str]] = [
    ("missing-path", lambda t: ["--model", str(t / "nope.gguf")], "does not exist"),
    ("folder-without-config", lambda t: ["--model", str(t)], "no config.json"),
    ("not-gguf", lambda t: ["--model", str(_text(t / "notes.gguf"))], "not a GGUF file"),
    ("empty-file", lambda t: ["--model", str(_text(t / "empty.gguf", ""))], "not a GGUF file"),
    ("truncated-header",
     lambda t: ["--model", str(head_of_default_model(t / "cut.gguf", 64 << 10))], "truncated"),
    ("truncated-data",
     lambda t: ["--model", str(head_of_default_model(t / "cut.gguf", 40 << 20))], "truncated"),
    ("not-a-regular-file", lambda t: ["--model", str(_fifo(t / "pipe.gguf"))],
     "not a regular file"),
    ("unreadable", lambda t: ["--model", str(_unreadable(t / "locked.gguf"))],
     "permission denied"),
    ("unsupported-architecture-gguf",
     lambda t: ["--model", str(write_gguf(t / "gpt2.gguf", "gpt2"))], "architecture 'gpt2'"),
    ("unsupported-architecture-hf", lambda t: ["--model", str(_hf_folder(t, "bert"))],
     "architecture 'bert'"),
    ("hf-without-safetensors", lambda t: ["--model", str(_hf_folder(t, "llama"))],
     "no *.safetensors files in "),
    ("max-model-len-beyond-gguf-context", lambda t: ["--max-model-len", "100000"],
     "--max-model-len 100000 exceeds the model's context length of 8192 tokens"),
    ("max-model-len-beyond-hf-context",
     lambda t: ["--model", str(_hf_folder(t, "llama", max_position_embeddings=64,
                                          safetensors=True)), "--max-model-len", "65"],
     "--max-model-len 65 exceeds the model's context length of 64 tokens"),
    ("gguf-without-tokenizer",
     lambda t: ["--model", str(write_gguf(t / "bare.gguf", "llama", tokenizer=False))],
     "no tokenizer"),
    ("kv-cache-below-two-blocks", lambda t: ["--kv-cache-memory", "0.00001"],
     "at least 2 are needed"),
    ("kv-cache-beyond-free-memory", lambda t: ["--kv-cache-memory", "1000000"],
     "memory this machine has free"),
    ("kv-blocks-override-beyond-free-memory",
     lambda t: ["--num-gpu-blocks-override", "100000000"], "memory this machine has free"),
    ("port-not-a-number", lambda t: ["--port", "http"], "invalid int value"),
    ("port-out-of-range", lambda t: ["--port", "70000"], "not a TCP port"),
    ("block-size-not-power-of-two", lambda t: ["--block-size", "3"], "power of two"),
    ("dtype-unknown", lambda t: ["--dtype", "int8"], "invalid choice"),
    ("kv-cache-dtype-under-bf16-activations",
     lambda t: ["--dtype", "bfloat16", "--kv-cache-dtype", "float16"], "needs --dtype float32"),
    ("fp8-kv-cache-under-bf16-activations",
     lambda t: ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8"],
     "--kv-cache-dtype fp8 needs --dtype float32 on a CPU"),
    ("fp8-kv-cache-on-cuda", lambda t: ["--device", "cuda", "--kv-cache-dtype", "fp8_e5m2"],
     "--kv-cache-dtype fp8_e5m2 needs --dtype float32 on a CPU"),
    ("max-num-seqs-zero", lambda t: ["--max-num-seqs", "0"], "max_num_seqs"),
    ("negative-drain-timeout", lambda t: ["--drain-timeout", "-1"], "--drain-timeout"),
    ("unknown-flag", lambda t: ["--no-such-flag"], "unrecognized arguments"),
]


def _text(path: Path, text: str = "not a model\n") -> Path:
    path.write_text(text)
    return path


def _fifo(path: Path) -> Path:
    os.mkfifo(path)  # opening it would block: the check must not open it
    return path


def _unreadable(path: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    path.write_bytes(b"GGUF")
    path.chmod(0)
    return path


def _hf_folder(tmp: Path, model_type: str, safetensors: bool = False, **config) -> Path:
    """An HF folder with a config.json (``config`` adds keys) and, with ``safetensors``,
    an empty ``model.safetensors`` (the checks only look for one)."""
    folder = tmp / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": model_type, "num_attention_heads": 2, "num_hidden_layers": 1,
        "hidden_size": 8, **config}))
    if safetensors:
        (folder / "model.safetensors").write_bytes(b"")
    return folder


def run_serve(*flags: str, timeout: float = 30) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "aioengine.entrypoints.cli", "serve", *flags],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT,
                          timeout=timeout)
    return proc, time.perf_counter() - t0


def assert_one_line_error(proc: subprocess.CompletedProcess, elapsed: float,
                          fragment: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("aioengine") and ": error: " in lines[0], lines[0]
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stdout == "", proc.stdout
    assert elapsed < BAD_START_LIMIT_S, f"took {elapsed:.2f} s: {lines[0]}"


@pytest.mark.parametrize("flags,fragment", [pytest.param(f, x, id=i) for i, f, x in CASES])
def test_bad_start_is_one_line_and_exit_code_1(tmp_path, flags, fragment):
    with socket.socket() as s:  # a free port, so no case meets a server that runs here
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = flags(tmp_path)
    if "--port" not in args:
        args = ["--port", str(port), *args]
    proc, elapsed = run_serve(*args)
    assert_one_line_error(proc, elapsed, fragment)


def test_port_in_use_is_one_line_and_exit_code_1(busy_port):
    proc, elapsed = run_serve("--port", str(busy_port))
    assert_one_line_error(proc, elapsed, "Address already in use")


# -- the checks themselves --------------------------------------------------------------------


def test_supported_architectures_match_the_model_code():
    from aioengine.models.registry import SUPPORTED_GGUF_ARCHITECTURES, SUPPORTED_MODEL_TYPES

    assert set(preflight.SUPPORTED_ARCHITECTURES) == set(SUPPORTED_MODEL_TYPES) | set(
        SUPPORTED_GGUF_ARCHITECTURES)


def test_the_default_model_passes_and_its_header_is_read_right():
    """The struct reader against what DESIGN.md states of SmolLM2-135M: a reader
    that skipped an array wrongly would misread every later key or call the
    file truncated."""
    from aioengine.config import EngineConfig

    t0 = time.perf_counter()
    shape = preflight.check_model(EngineConfig())
    assert time.perf_counter() - t0 < 1.0
    assert (shape.architecture, shape.num_layers, shape.num_kv_heads, shape.head_dim,
            shape.context_length) == ("llama", 30, 3, 64, 8192)
    header = preflight.read_gguf_header(default_model_path())
    size = os.path.getsize(default_model_path())
    assert header.num_tensors == 272
    assert header.metadata["llama.attention.head_count"] == 9
    assert header.metadata["general.name"].lower().startswith("smollm2")
    assert 0 <= size - header.data_end < 64  # the last tensor ends at the file's end
    # 30 layers x K and V x 16 tokens x 3 heads x 64 x 4 bytes, as ModelRunner sizes it.
    assert shape.kv_bytes_per_block(16, "float32") == 737280
    # A narrower cache holds more blocks in the same memory, as the worker counts them.
    assert shape.kv_bytes_per_block(16, "float32", kv_cache_dtype="float16") == 737280 // 2
    assert shape.kv_bytes_per_block(16, "float32", kv_cache_dtype="fp8_e5m2") == 737280 // 4


def test_preflight_sizes_the_cache_by_kv_cache_dtype():
    """Room for 3 fp8 blocks is fewer than 2 fp32 blocks: the start is refused with
    the activations' cache and allowed with ``--kv-cache-dtype fp8``."""
    from aioengine.config import CacheConfig, EngineConfig

    room = 3 * 737280 // 4
    with pytest.raises(preflight.StartupError, match="holds 0 KV block"):
        preflight.check_model(EngineConfig(cache=CacheConfig(kv_cache_memory_bytes=room)))
    preflight.check_model(EngineConfig(cache=CacheConfig(kv_cache_memory_bytes=room,
                                                         kv_cache_dtype="fp8")))


def test_one_line_of_a_worker_traceback():
    from aioengine.entrypoints.cli import one_line

    error = RuntimeError("worker error:\nTraceback (most recent call last):\n  File x\n"
                         "ValueError: kv_cache_memory_bytes=10 holds 0 blocks\n\n")
    assert one_line(error) == "ValueError: kv_cache_memory_bytes=10 holds 0 blocks"
    assert one_line(RuntimeError("")) == "RuntimeError"


GENERATE_KV_CACHE_CASES = [
    ("fp8-under-bf16", ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8"],
     "--kv-cache-dtype fp8 needs --dtype float32 on a CPU"),
    ("fp8-e5m2-under-fp16", ["--dtype", "float16", "--kv-cache-dtype", "fp8_e5m2"],
     "--kv-cache-dtype fp8_e5m2 needs --dtype float32 on a CPU"),
    ("bf16-under-fp16", ["--dtype", "float16", "--kv-cache-dtype", "bfloat16"],
     "needs --dtype float32"),
]


@pytest.mark.parametrize("flags,fragment",
                         [pytest.param(f, x, id=i) for i, f, x in GENERATE_KV_CACHE_CASES])
def test_generate_refuses_a_kv_cache_dtype_in_one_line(flags, fragment):
    """``aioengine generate`` shares ``serve``'s engine flags: a ``--kv-cache-dtype`` the
    worker refuses ends in one line, before the model loads, not in the worker's
    ValueError traceback after it (as it did before ``_check_kv_cache_dtype``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "aioengine.entrypoints.cli", "generate", "hi",
                           "--max-tokens", "1", *flags],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=60)
    assert_one_line_error(proc, time.perf_counter() - t0, fragment)
