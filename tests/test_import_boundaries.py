"""Import boundaries of the engine process, and no import cycles.

DESIGN.md: the engine process never loads model code. It starts the worker,
tokenizes, schedules and detokenizes; the forward pass, the model families
and the kernels live in the worker subprocess. Allowed in the engine process
from ``aioengine.models`` are only the metadata modules that check a model
before any worker starts, all torch-free by their own docstrings:
``arch`` (shapes, tensor-parallel checks), ``loader`` (``inspect_model``,
``load_hf_config``; its weight functions import torch only when called),
``gguf_file`` and ``gguf_loader`` (the GGUF header and config) and
``registry`` (the family table, which imports a model class only on demand).
From ``aioengine.distributed`` only ``layout`` (which ranks run on which node,
torch-free) is allowed: the collectives and the weight split stay in the worker.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aioengine.config import default_model_path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED_MODEL_MODULES = {
    "aioengine.models",
    "aioengine.models.arch",
    "aioengine.models.loader",
    "aioengine.models.gguf_file",
    "aioengine.models.gguf_loader",
    "aioengine.models.registry",
}
ALLOWED_DISTRIBUTED_MODULES = {"aioengine.distributed", "aioengine.distributed.layout"}
FORBIDDEN_PREFIXES = ("aioengine.worker", "aioengine.distributed", "triton_kernels")

ENGINE_SCRIPT = """
import asyncio, json, sys
from aioengine import AsyncEngine, EngineConfig, SamplingParams

async def main():
    config = EngineConfig.from_kwargs(model=sys.argv[1], num_gpu_blocks_override=64,
                                      standby_worker=False)
    engine = await AsyncEngine.start(config)
    try:
        async for out in engine.generate("Hello", SamplingParams(temperature=0, max_tokens=2)):
            text = out.outputs[0].text
    finally:
        await engine.shutdown()
    print(json.dumps({"modules": sorted(sys.modules), "text": text}))

asyncio.run(main())
"""


SERVER_SCRIPT = """
import json, sys
from starlette.testclient import TestClient
from aioengine import EngineConfig
from aioengine.entrypoints.openai.api_server import build_app

config = EngineConfig.from_kwargs(model=sys.argv[1], num_gpu_blocks_override=64,
                                  standby_worker=False)
with TestClient(build_app(config)) as client:
    health = client.get("/health").status_code
    reply = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2,
                                                 "temperature": 0})
    text = reply.json()["choices"][0]["text"]
print(json.dumps({"modules": sorted(sys.modules), "health": health, "text": text}))
"""


def run_report(script: str) -> dict:
    """Run ``script`` on the default model in a fresh interpreter; its last line's JSON."""
    result = subprocess.run(
        [sys.executable, "-c", script, default_model_path()],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def offending(modules: list[str]) -> list[str]:
    bad = [
        m
        for m in modules
        if m.startswith(FORBIDDEN_PREFIXES) and m not in ALLOWED_DISTRIBUTED_MODULES
    ]
    bad += [
        m for m in modules if m.startswith("aioengine.models") and m not in ALLOWED_MODEL_MODULES
    ]
    return sorted(bad)


def test_the_boundary_rule_itself():
    assert offending(["aioengine.models.arch", "aioengine.engine.core"]) == []
    assert offending(
        ["aioengine.models.llama", "aioengine.worker.sampler", "triton_kernels.quant"]
    ) == ["aioengine.models.llama", "aioengine.worker.sampler", "triton_kernels.quant"]
    assert offending(["aioengine.distributed.layout"]) == []
    assert offending(["aioengine.distributed.parallel_state"]) == [
        "aioengine.distributed.parallel_state"
    ]


@pytest.mark.e2e
def test_engine_process_never_imports_model_code_worker_or_kernels():
    """A real ``AsyncEngine`` with its worker subprocess generates two tokens;
    the engine process's ``sys.modules`` then holds none of the worker's code."""
    report = run_report(ENGINE_SCRIPT)
    assert report["text"], "the engine generated nothing"
    assert "aioengine.engine.core" in report["modules"]
    assert offending(report["modules"]) == []


@pytest.mark.e2e
def test_server_start_never_imports_torch_in_the_engine_process():
    """The API server's start-up (lifespan, tokenizer, worker spawn) and a
    completion leave torch out of the engine process: importing it there
    (``AutoTokenizer`` does) cost about 3 s of a 4 s start, serially before
    the worker was spawned."""
    report = run_report(SERVER_SCRIPT)
    assert report["health"] == 200 and report["text"]
    assert "torch" not in report["modules"]
    assert offending(report["modules"]) == []


def module_imports(package: str) -> dict[str, set[str]]:
    """Module-level ``aioengine`` imports of every module under ``package``
    (imports inside functions are deliberate lazy edges and are left out)."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / package.replace(".", "/")).rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        edges: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                edges.add(node.module)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = {e for e in edges if e.startswith("aioengine")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_engine_packages():
    graph = module_imports("aioengine")
    assert "aioengine.executor.abstract" in graph
    assert find_cycle(graph) is None
