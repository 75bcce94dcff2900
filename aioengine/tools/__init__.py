"""Tool calling (OpenAI ``tools`` / ``tool_choice``).

- ``prompt.py``: tools and tool turns rendered into the conversation, through
  the model's chat template when it knows tools, else a documented
  Hermes-style system prompt.
- ``constraint.py``: the JSON schema that forces a call (``required`` or a
  named function), so a forced call always parses.
- ``parsers.py``: the model's own call formats (Hermes/Qwen ``<tool_call>``,
  Llama 3 JSON, Mistral ``[TOOL_CALLS]``) and the forced-call JSON, parsed
  incrementally so streamed argument fragments join to the full arguments.
"""
