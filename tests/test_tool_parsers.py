"""``aioengine.tools``: the tool-call parsers, streamed against whole, the
forced-call schema and the prompt rendering for templates without tools."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioengine.tools.constraint import tool_call_schema
from aioengine.tools.parsers import TOOL_PARSERS, ToolCallStreamer, parser_for_template
from aioengine.tools.prompt import inject_tools, template_supports_tools

CASES = [
    ("hermes", 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Pa\\"ris}", "days": [1, 2]}}\n</tool_call>',
     "Let me look.", [("get_weather", '{"city": "Pa\\"ris}", "days": [1, 2]}')]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>'
               '{"name": "b", "arguments": {"x": "<tool_call>"}}</tool_call>',
     "", [("a", "{}"), ("b", '{"x": "<tool_call>"}')]),
    ("hermes", "No call here < not a tag", "No call here < not a tag", []),
    ("hermes", '<tool_call>{"arguments": {"q": 1}, "name": "late"}</tool_call>',
     "", [("late", '{"q": 1}')]),
    ("llama3_json", '{"name": "search", "parameters": {"query": "cats"}}', "",
     [("search", '{"query": "cats"}')]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; '
                    '{"name": "b", "parameters": {"k": [1]}}', "",
     [("a", "{}"), ("b", '{"k": [1]}')]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "Plain prose.", "Plain prose.", []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "a", "arguments": {"n": 1}}, '
                '{"name": "b", "arguments": {}}]', "Sure.", [("a", '{"n": 1}'), ("b", "{}")]),
    ("json", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "",
     [("get_weather", '{"city": "Oslo"}')]),
]


def stream(parser: str, text: str, cuts: list[int]) -> tuple[str, dict, dict, list]:
    """Feed ``text`` grown at ``cuts``; returns content, names, joined
    arguments per index and the final ``tool_calls``."""
    streamer = ToolCallStreamer(TOOL_PARSERS[parser]())
    content, names, args, ids = "", {}, {}, {}
    points = sorted({c for c in cuts if 0 < c < len(text)})
    for i, end in enumerate([*points, len(text)]):
        final = i == len(points)
        piece, deltas = streamer.finish(text) if final else streamer.update(text[:end])
        content += piece
        for d in deltas:
            if "id" in d:
                assert d["index"] not in names, "a call's name and id come once"
                names[d["index"]], ids[d["index"]] = d["function"]["name"], d["id"]
            else:
                assert d["index"] in names, "arguments before the call's name"
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    return content, names, args, streamer.tool_calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_text_gives_the_content_and_calls(parser, text, content, calls):
    got_content, _, _, tool_calls = stream(parser, text, [])
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls] == calls
    for call in tool_calls:
        json.loads(call["function"]["arguments"])
        assert call["id"].startswith("call_") and call["type"] == "function"


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=40))
def test_streamed_fragments_join_to_the_whole_texts_calls(case, cuts):
    parser, text, content, calls = case
    got_content, names, args, tool_calls = stream(parser, text, cuts)
    assert got_content == content
    assert [(names[i], args.get(i, "")) for i in sorted(names)] == calls
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls] == calls


def test_parser_is_picked_from_the_template():
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("<|python_tag|>{{ x }}") == "llama3_json"
    assert parser_for_template("<tool_call>") == "hermes"
    assert parser_for_template(None) == "hermes"


def test_forced_call_schema_names_the_tools_and_bounds_the_calls():
    functions = [{"name": "a", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}}, {"name": "b"}]
    one = tool_call_schema(functions, "b", parallel=True)
    assert one["maxItems"] == 1
    assert one["items"]["properties"]["name"] == {"const": "b"}
    any_of = tool_call_schema(functions, None, parallel=False)
    assert any_of["maxItems"] == 1 and len(any_of["items"]["anyOf"]) == 2
    assert tool_call_schema(functions, None, parallel=True)["maxItems"] > 1


def test_tools_and_tool_turns_are_injected_for_a_template_without_tools():
    assert not template_supports_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert template_supports_tools("{% if tools %}...{% endif %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "-3 C", "tool_call_id": "call_1"},
    ]
    out = inject_tools(messages, tools)
    assert out[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "Oslo"}}\n</tool_call>')
    assert out[3] == {"role": "tool", "content": "<tool_response>\n-3 C\n</tool_response>"}
    assert inject_tools([{"role": "user", "content": "x"}], tools)[0]["role"] == "system"
