"""Structured outputs: grammar-constrained decoding (vLLM v1's shape).

- ``params.py``: ``StructuredOutputsParams``, what a request asks for.
- ``backend.py``: the grammar library (xgrammar): compile, matcher, bitmask.
- ``request.py``: ``StructuredOutputRequest``, one request's grammar and matcher.
- ``manager.py``: ``StructuredOutputManager``, the compile cache (in a thread)
  and the per-step ``grammar_bitmask`` the worker applies to the logits.
"""

from aioengine.structured.params import GrammarError, StructuredOutputsParams

__all__ = ["GrammarError", "StructuredOutputsParams"]
