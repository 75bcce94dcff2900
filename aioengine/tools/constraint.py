"""The grammar of a forced tool call: a JSON array of ``{"name", "arguments"}``
objects whose ``arguments`` follow each tool's parameter schema.

``tool_choice: "required"`` allows any of the tools, a named choice only that
one; ``parallel_tool_calls: false`` (or a named choice) allows exactly one
call. vLLM constrains forced calls the same way (an array of name/parameters
objects); the output is parsed by ``parsers.JsonArrayToolParser``.
"""

from __future__ import annotations

from typing import Any

# A bound on parallel calls keeps a weak model from looping until max_tokens.
MAX_PARALLEL_TOOL_CALLS = 8


def tool_call_schema(functions: list[dict[str, Any]], named: str | None,
                     parallel: bool) -> dict[str, Any]:
    """JSON schema of the forced output.

    Args:
        functions: the request's ``tools[].function`` dicts (``name``,
            ``parameters``).
        named: the one function a named ``tool_choice`` asks for, else None.
        parallel: ``parallel_tool_calls`` (ignored for a named choice).
    """
    items = []
    for function in functions:
        if named is not None and function["name"] != named:
            continue
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        items.append({"type": "object",
                      "properties": {"name": {"const": function["name"]},
                                     "arguments": parameters},
                      "required": ["name", "arguments"]})
    item = items[0] if len(items) == 1 else {"anyOf": items}
    many = parallel and named is None
    return {"type": "array", "items": item, "minItems": 1,
            "maxItems": MAX_PARALLEL_TOOL_CALLS if many else 1}
