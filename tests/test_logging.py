"""``aioengine serve --log-level`` reaches our loggers in the server and in its spawned
workers (which start with Python's default, warnings-only logging)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aioengine.logger import LOG_LEVEL_ENV, configure_logging

SCRIPT = """
import sys
from aioengine import LLM
from aioengine.logger import configure_logging
configure_logging(sys.argv[2] if len(sys.argv) > 2 else None)
llm = LLM(sys.argv[1], max_model_len=64)  # the default process executor: a spawned worker
llm.shutdown()
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer_dir) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=128)
                     ).save_pretrained(path, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


def run(tiny_model: Path, *level: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != LOG_LEVEL_ENV}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model), *level], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_info_level_reaches_the_spawned_worker(tiny_model):
    stderr = run(tiny_model, "info")
    # Logged only in the worker process, which learns the level from the environment.
    assert "INFO aioengine.worker.model_runner: model ready" in stderr, stderr[-3000:]
    assert "triton_kernels.cpu_ops" in stderr  # in use, or why not


def test_without_a_level_info_lines_stay_quiet(tiny_model):
    assert "model ready" not in run(tiny_model)


def test_unknown_level_is_refused():
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("loud")

