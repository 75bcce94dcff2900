"""aioengine: an asyncio-native LLM serving engine (paged KV cache, prefix
caching, continuous batching, OpenAI API over SSE and WebSocket)."""

from aioengine.config import EngineConfig
from aioengine.engine.beam_search import BeamSearchParams
from aioengine.sampling_params import CompletionOutput, RequestOutput, SamplingParams
from aioengine.structured.params import StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: importing aioengine must not import torch (the CLI starts fast).
    if name == "LLM":
        from aioengine.engine.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from aioengine.engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
