"""Shared pieces of the benchmarks: workloads, percentiles, results, servers.

- Workloads are fixed-seed lists of ``BenchRequest`` (prompt token ids and an
  exact output length; every benchmark runs with ``ignore_eos`` so both sides
  of a comparison generate the same number of tokens).
- ``synthetic_workload``: random token ids, lengths uniform in a range (the
  "random" dataset of vLLM's benchmarks).
- ``chat_workload``: a handful of real chat prompts through the model's chat
  template.
- ``percentiles``, ``latency_summary``: p50/p90/p99 in milliseconds.
- ``write_results``: JSON into ``bench/results/`` (git-ignored) with the
  machine's load average, so a figure is never separated from its conditions.
- ``BenchServer``: an ``aioengine serve`` subprocess on a free loopback port.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Self

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Token ids below this are special or control tokens in SmolLM2's vocabulary
# (<|endoftext|>, <|im_start|>, ...); synthetic prompts avoid them.
MIN_SYNTHETIC_TOKEN_ID = 100

# Real chat prompts (the kind a chat page receives), for ``--dataset chat``.
CHAT_PROMPTS = [
    "What is the capital of France, and what is it famous for?",
    "Explain the difference between a list and a tuple in Python.",
    "Write a short poem about the sea at night.",
    "How do vaccines train the immune system? Keep it simple.",
    "Give me three ideas for a vegetarian dinner that takes under 30 minutes.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "What are the main causes of the seasons on Earth?",
    "I have a job interview tomorrow for a junior developer role. How should I prepare?",
    "Translate 'Where is the train station?' into Spanish and German.",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What should I pack for a three-day hiking trip in the mountains?",
    "Compare electric cars and petrol cars in terms of running costs.",
    "Tell me a fun fact about octopuses.",
    "How does a bill become a law in the United States?",
    "Suggest a name for a small coffee shop near a university campus.",
]

# Padding sentences that bring a chat prompt to about 50 tokens (serving's
# "8 concurrent chat streams with ~50-token prompts" scenario).
CHAT_CONTEXT = "Please keep the answer short and clear."


@dataclass
class BenchRequest:
    """One request of a workload.

    Attributes:
        prompt_token_ids: the prompt, already tokenized (chat template applied
            for chat prompts).
        output_len: tokens to generate (exact: ``ignore_eos``).
        messages: the chat conversation, for chat prompts sent to a server's
            chat endpoint (``None`` for synthetic prompts).
    """

    prompt_token_ids: list[int]
    output_len: int
    messages: list[dict[str, str]] | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def synthetic_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                       vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """Random-token prompts with lengths uniform in ``input_len`` and
    ``output_len`` (inclusive, tokens). Prompts share no prefix, so the prefix
    cache gets no hits."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        ids = [rng.randrange(MIN_SYNTHETIC_TOKEN_ID, vocab_size) for _ in range(n_in)]
        requests.append(BenchRequest(ids, n_out))
    return requests


def chat_messages(prompt: str, pad_to_50_tokens: bool = False) -> list[dict[str, str]]:
    content = f"{prompt} {CHAT_CONTEXT}" if pad_to_50_tokens else prompt
    return [{"role": "user", "content": content}]


def chat_workload(tokenizer, num_requests: int, output_len: tuple[int, int], seed: int = 0,
                  pad_to_50_tokens: bool = False) -> list[BenchRequest]:
    """``num_requests`` prompts cycled from ``CHAT_PROMPTS`` through the model's
    chat template (the same token ids the server's chat endpoint makes),
    output lengths uniform in ``output_len``.

    With ``pad_to_50_tokens`` each question gets one more sentence, which
    brings the templated prompt (with SmolLM2's default system prompt) to
    45-55 tokens.
    """
    rng = random.Random(seed)
    order = list(range(len(CHAT_PROMPTS)))
    rng.shuffle(order)
    requests = []
    for i in range(num_requests):
        messages = chat_messages(CHAT_PROMPTS[order[i % len(order)]], pad_to_50_tokens)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        requests.append(BenchRequest(ids, rng.randint(*output_len), messages))
    return requests


def workload_summary(requests: Sequence[BenchRequest]) -> dict:
    ins = [r.prompt_len for r in requests]
    outs = [r.output_len for r in requests]
    return {"num_requests": len(requests), "prompt_tokens": sum(ins),
            "output_tokens": sum(outs), "prompt_len_min": min(ins), "prompt_len_max": max(ins),
            "output_len_min": min(outs), "output_len_max": max(outs)}


# -- statistics ------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile ``p`` (0-100) of already sorted values
    (numpy's default method)."""
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def latency_summary(values_s: Iterable[float], ps: Sequence[float] = (50, 90, 99)) -> dict:
    """``{"mean_ms", "p50_ms", "p90_ms", "p99_ms", "count"}`` of values in seconds."""
    values = sorted(v * 1000.0 for v in values_s)
    out: dict[str, float | int] = {"count": len(values)}
    out["mean_ms"] = round(statistics.fmean(values), 3) if values else float("nan")
    for p in ps:
        out[f"p{p:g}_ms"] = round(percentile(values, p), 3)
    return out


# -- environment and results ----------------------------------------------------------------


def loadavg() -> list[float]:
    """The 1-, 5- and 15-minute load averages (``/proc/loadavg``)."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return [float(x) for x in os.getloadavg()]


@dataclass
class LoadTracker:
    """Load averages sampled at the start, at ``sample()`` calls and at the end
    of a run (other people's jobs share this machine; a figure without its load
    is meaningless)."""

    samples: list[tuple[float, list[float]]] = field(default_factory=list)
    t0: float = field(default_factory=time.time)

    def sample(self) -> list[float]:
        load = loadavg()
        self.samples.append((round(time.time() - self.t0, 1), load))
        return load

    def summary(self) -> dict:
        ones = [s[1][0] for s in self.samples] or [float("nan")]
        return {"loadavg_1m_min": min(ones), "loadavg_1m_max": max(ones),
                "samples": [{"t_s": t, "loadavg": la} for t, la in self.samples]}


def environment(threads: int, dtype: str) -> dict:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__,
            "machine": platform.machine(), "cpus": os.cpu_count(), "threads": threads,
            "dtype": dtype, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv}


def write_results(path: str | Path | None, default_name: str, report: dict) -> Path:
    """Write ``report`` as JSON to ``path`` (default ``bench/results/<name>``)."""
    out = Path(path) if path else RESULTS_DIR / default_name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    return out


def _json_default(obj: object) -> object:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)  # type: ignore[arg-type]
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def fmt(value: float, digits: int = 1) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.{digits}f}"


# -- a server subprocess ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BenchServer:
    """``python -m aioengine.entrypoints.cli serve`` on a free loopback port.

    Use as a context manager; the server gets SIGTERM (then SIGKILL) on exit.

    Args:
        args: extra ``serve`` flags (``--dtype``, ``--no-enable-chunked-prefill`` ...).
        log_path: the server's stdout and stderr.
        start_timeout_s: how long to wait for ``GET /health``.

    Raises (on enter):
        RuntimeError: the server exited or did not become healthy in time;
            the message holds the end of its log.
    """

    def __init__(self, args: Sequence[str], log_path: str | Path,
                 start_timeout_s: float = 600.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        import httpx

        cmd = [sys.executable, "-m", "aioengine.entrypoints.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), *self.args]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            cwd=REPO_ROOT)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"server not healthy after {self.start_timeout_s} s:\n{self.log_tail()}")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""
