"""Tools and tool turns in the prompt.

A chat template that knows tools (its source mentions ``tools``) gets them
through ``apply_chat_template(tools=...)`` and the messages unchanged. A
template that does not (SmolLM2's plain ChatML) gets what llama.cpp and vLLM
fall back to: the tool list in the system prompt, in the Hermes format
(NousResearch Hermes 2 Pro function calling, also Qwen 2.5's), assistant
calls of the history written back as ``<tool_call>`` blocks and tool results
wrapped in ``<tool_response>``. The Hermes parser then reads the answers.
"""

from __future__ import annotations

import json
from typing import Any

TOOL_SYSTEM_PROMPT = """You can call functions. The functions are listed, as JSON \
signatures, inside <tools></tools>:
<tools>
{tools}
</tools>
To call a function, answer with a JSON object inside <tool_call></tool_call> tags:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>
Function results come back inside <tool_response></tool_response>."""


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself."""
    return bool(chat_template) and "tools" in chat_template


def inject_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                 ) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tools in the system
    prompt (when given), tool calls and results as Hermes text.

    Args:
        messages: ``ChatMessage.to_template_dict()`` dicts.
        tools: OpenAI ``tools`` entries (``{"type": "function", "function": ...}``).
    """
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            blocks = [json.dumps({"name": c["function"]["name"],
                                  "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                      for c in calls]
            text = message.get("content") or ""
            message["content"] = (text + "\n" if text else "") + "\n".join(
                f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
        if message["role"] == "tool":
            message.pop("tool_call_id", None)
            message["content"] = f"<tool_response>\n{message['content']}\n</tool_response>"
        out.append(message)
    if tools:
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        system = TOOL_SYSTEM_PROMPT.format(tools=listing)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out
