"""The worker subprocess behind shared-memory rings: handshake, steps,
shutdown without leaked segments, and a SIGKILLed worker."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from aioengine import LLM, SamplingParams
from aioengine.engine.multiproc_executor import WorkerDiedError


def segments(names: list[str]) -> list[str]:
    return [n for n in names if os.path.exists(f"/dev/shm/{n.lstrip('/')}")]


def test_handshake_steps_and_clean_shutdown():
    llm = LLM(num_gpu_blocks_override=300)
    executor = llm.executor
    names = [executor.ring_in.name, executor.ring_out.name]
    try:
        assert executor.num_blocks == 300, "num_blocks comes from the worker's handshake"
        assert executor.pid != os.getpid() and executor.is_alive()
        assert len(segments(names)) == 2
        out = llm.generate(["The capital of France is"],
                           SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        llm.shutdown()
    assert segments(names) == [], "the engine unlinks every segment at shutdown"
    assert not executor.is_alive()


def test_killed_worker_is_reported_and_segments_unlinked():
    llm = LLM(num_gpu_blocks_override=300)
    executor = llm.executor
    names = [executor.ring_in.name, executor.ring_out.name]
    killer = threading.Timer(2.0, os.kill, (executor.pid, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerDiedError):
            llm.generate(["Tell me a very long story."],
                         SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True),
                         use_tqdm=False)
        assert time.monotonic() - t0 < 2.0 + 1.0, "the death is noticed within a second"
    finally:
        killer.cancel()
        llm.shutdown()
    assert segments(names) == []
