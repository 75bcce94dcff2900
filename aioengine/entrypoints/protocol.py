"""OpenAI-compatible request/response schemas and OpenAI-shaped errors.

Requests are pydantic v2 models in strict mode: a wrongly typed field
(``"temperature": "hot"``, ``"max_tokens": "5"``) is a 400, never coerced.
``null`` means the field is absent. Unknown fields are ignored, as OpenAI's
own API and vLLM do, so clients written for newer API versions keep working.
Value ranges are checked once, by ``SamplingParams`` (the engine's own
validation); ``to_sampling_params`` maps its errors back to the request's
field names.

Every error leaves the server as ``{"error": {"message", "type", "param",
"code"}}`` through ``APIError``.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from aioengine.engine.beam_search import BeamSearchParams
from aioengine.sampling_params import SamplingParamError, SamplingParams
from aioengine.structured.params import StructuredOutputsParams

RequestT = TypeVar("RequestT", bound=BaseModel)

# -- authentication -------------------------------------------------------------------------


def bearer_token(authorization: str | bytes | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, else None.

    The scheme name is case-insensitive and may be followed by more than one
    space (RFC 9110 §11.1, §11.4; RFC 6750 §2.1), so ``bearer KEY`` works too.
    """
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.lstrip(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    return token


# -- errors ---------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered as OpenAI-shaped JSON.

    Attributes:
        status: HTTP status (400, 401, 404, 413, 429, 500, 503).
        message: human-readable text.
        param: the request field at fault, if any.
        code: short machine-readable code (``"invalid_value"``, ``"model_not_found"`` ...).
        retry_after: seconds, sent as ``Retry-After`` (429, 503).
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist", "model", "model_not_found")


def _loc_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


_UNION_HINTS = {
    "stop": "must be a string or a list of strings",
    "prompt": "must be a string, a list of strings, a list of token ids or a list of "
              "token-id lists",
    "content": "must be a string or a list of {'type': 'text', 'text': ...} parts",
}


def validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field.

    A field with a union type (``stop``, ``prompt``, ``content``) fails once
    per branch; those are reported once, at the field, with a hint of the
    accepted shapes instead of pydantic's per-branch messages.
    """
    errors = exc.errors(include_url=False)
    first = errors[0]
    kind, loc = first["type"], tuple(first["loc"])
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}", None,
                        "invalid_json")
    if not loc:
        return APIError(400, "the request body must be a JSON object", None, "invalid_type")
    param = str(loc[0])
    if kind == "missing":
        # A model validator's missing field (ChatMessage.content) is reported at the
        # model's location; its context names the field and why it is required there.
        ctx = first.get("ctx") or {}
        if "field" in ctx:
            loc = (*loc, ctx["field"])
        why = f": {ctx['why']}" if "why" in ctx else ""
        return APIError(400, f"'{_loc_path(loc)}' is a required field{why}", param,
                        "missing_required_parameter")
    branches = [tuple(e["loc"]) for e in errors if e["loc"] and e["loc"][0] == loc[0]]
    if len(branches) > 1:
        prefix = loc
        for other in branches[1:]:
            n = 0
            while n < min(len(prefix), len(other)) and prefix[n] == other[n]:
                n += 1
            prefix = prefix[:n]
        hint = _UNION_HINTS.get(str(prefix[-1]), "has an invalid type or value")
        return APIError(400, f"'{_loc_path(prefix)}' {hint}", param, "invalid_type")
    code = "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value"
    return APIError(400, f"'{_loc_path(loc)}': {first['msg']}", param, code)


def parse_request(schema: type[RequestT], body: bytes | str) -> RequestT:
    """Validate a JSON body against ``schema``.

    Raises:
        APIError: 400 for malformed JSON, a non-object body or any bad field.
    """
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def parse_object(schema: type[RequestT], data: dict[str, Any]) -> RequestT:
    """Validate already decoded JSON (WebSocket messages); see ``parse_request``."""
    try:
        # Strict validation of Python objects would reject JSON-compatible
        # values (a list for a tuple ...); round-trip through JSON semantics.
        return schema.model_validate_json(json.dumps(data))
    except ValidationError as exc:
        raise validation_error(exc) from None


# -- requests -------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool | None = None


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallInput(_Request):
    """A tool call of an earlier assistant turn in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """One conversation turn. ``content`` may be a string or a list of text parts;
    an assistant turn may carry ``tool_calls``, a ``tool`` turn its ``tool_call_id``.

    ``content`` is required (absent and ``null`` alike are a 400
    ``missing_required_parameter``), as OpenAI requires it, except in an assistant
    turn with ``tool_calls``: a misspelt key (``"contnet"``) must not become an
    empty turn that is silently answered.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallInput] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            why = ("an assistant message needs 'content' or 'tool_calls'"
                   if self.role == "assistant" else f"a {self.role} message needs 'content'")
            raise PydanticCustomError("missing", "Field required",
                                      {"field": "content", "why": why})
        return self

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it: ``tool_calls[].function.arguments``
        decoded to an object (HF's convention, as vLLM passes it)."""
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        message: dict[str, Any] = {"role": self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    arguments = call.function.arguments
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            message["tool_calls"] = calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class JsonSchemaFormat(_Request):
    """``response_format.json_schema`` (OpenAI)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs`` object: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class SamplingRequest(_Request):
    """Fields shared by chat and completion requests (OpenAI plus vLLM extras)."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    max_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    priority: int | None = None
    cache_salt: str | None = None
    user: str | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* fields (one of them at a time).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's beam-search extension: n beams, the n best returned (no streaming).
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """``(constraint, request field it came from)``, or ``(None, None)``.

        Raises:
            APIError: 400 for two constraints at once or an incomplete one.
        """
        found: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format 'json_schema' needs "
                               "'json_schema': {'name': ..., 'schema': {...}}",
                               "response_format", "invalid_value")
            found.append(("response_format", {"json": rf.json_schema.schema_}))
        so = self.structured_outputs
        if so is not None:
            given = {"json": so.json_, "regex": so.regex, "choice": so.choice,
                     "grammar": so.grammar, "json_object": so.json_object or None}
            given = {k: v for k, v in given.items() if v is not None}
            if len(given) != 1:
                raise APIError(400, "'structured_outputs' must set exactly one of json, regex, "
                               "choice, grammar and json_object", "structured_outputs",
                               "invalid_value")
            found.append(("structured_outputs", given))
        for field, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                            ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                found.append((field, {kind: getattr(self, field)}))
        if not found:
            return None, None
        if len(found) > 1:
            raise APIError(400, f"give one output constraint, not both '{found[0][0]}' and "
                           f"'{found[1][0]}'", found[1][0], "invalid_value")
        field, kwargs = found[0]
        if "choice" in kwargs:
            kwargs["choice"] = tuple(kwargs["choice"])
        try:
            return StructuredOutputsParams(**kwargs), field
        except ValueError as exc:
            raise APIError(400, f"'{field}': {exc}", field, "invalid_value") from None

    # Overridden by subclasses: which request field set SamplingParams.max_tokens /
    # SamplingParams.logprobs, and the number of top logprobs wanted.
    def _max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def _logprobs(self) -> tuple[int | None, str]:
        return None, "logprobs"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, default_max_tokens: int | None
                           ) -> SamplingParams | BeamSearchParams:
        """The engine's ``SamplingParams`` for this request (``BeamSearchParams`` with
        ``use_beam_search``).

        Args:
            default_max_tokens: used when the request gives none (tokens).

        Raises:
            APIError: 400 naming the request field that is out of range.
        """
        max_tokens, max_tokens_field = self._max_tokens()
        logprobs, logprobs_field = self._logprobs()
        logit_bias: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            # Plain decimal only: int() would also take " 5", "1_0" and non-ASCII digits.
            if not re.fullmatch(r"-?[0-9]{1,20}", key):
                raise APIError(400, f"'logit_bias' keys must be token ids, got {key!r}",
                               "logit_bias", "invalid_value")
            logit_bias[int(key)] = bias
        if self.cache_salt is not None and not self.cache_salt:
            raise APIError(400, "'cache_salt' must not be empty", "cache_salt", "invalid_value")
        if self.use_beam_search:
            return self._beam_search_params(
                max_tokens if max_tokens is not None else default_max_tokens, max_tokens_field,
                logprobs, logprobs_field)
        given = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "stop_token_ids": self.stop_token_ids,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
            "logprobs": logprobs, "logit_bias": logit_bias or None,
            "skip_special_tokens": self.skip_special_tokens,
        }
        kwargs = {k: v for k, v in given.items() if v is not None}
        kwargs["structured_outputs"] = self.structured_outputs_params()[0]
        kwargs["max_tokens"] = max_tokens if max_tokens is not None else default_max_tokens
        try:
            return SamplingParams(**kwargs)
        except SamplingParamError as exc:
            param = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}.get(
                exc.param, exc.param)
            message = str(exc).replace(exc.param, param, 1) if param != exc.param else str(exc)
            raise APIError(400, message, param, "invalid_value") from None


    def _beam_search_params(self, max_tokens: int | None, max_tokens_field: str,
                            logprobs: int | None, logprobs_field: str) -> BeamSearchParams:
        """``use_beam_search``: ``n`` beams (vLLM's extension). Streaming and the
        per-token features beam search has no meaning for are refused with a 400."""
        refused = [("stream", bool(self.stream), "streaming (the best beams are only known "
                    "when the search ends; send 'stream': false)"),
                   (logprobs_field, logprobs is not None, "logprobs"),
                   ("stop", bool(self.stop), "stop strings"),
                   ("structured_outputs", self.structured_outputs_params()[0] is not None,
                    "structured outputs")]
        for field, present, what in refused:
            if present:
                raise APIError(400, f"beam search does not support {what}", field,
                               "unsupported")
        # Settings that change the distribution beams are ranked by (a neutral value is
        # fine: clients often send their defaults).
        neutral = {"top_p": (self.top_p, (None, 1.0)), "top_k": (self.top_k, (None, 0, -1)),
                   "min_p": (self.min_p, (None, 0.0)),
                   "presence_penalty": (self.presence_penalty, (None, 0.0)),
                   "frequency_penalty": (self.frequency_penalty, (None, 0.0)),
                   "repetition_penalty": (self.repetition_penalty, (None, 1.0)),
                   "min_tokens": (self.min_tokens, (None, 0)),
                   "logit_bias": (self.logit_bias or None, (None,))}
        for field, (value, allowed) in neutral.items():
            if value not in allowed:
                raise APIError(400, f"'{field}' does not apply to beam search", field,
                               "unsupported")
        kwargs: dict[str, Any] = {"beam_width": 1 if self.n is None else self.n,
                                  "max_tokens": max_tokens, "ignore_eos": bool(self.ignore_eos),
                                  "temperature": self.temperature or 0.0}
        if self.length_penalty is not None:
            kwargs["length_penalty"] = self.length_penalty
        if self.early_stopping is not None:
            kwargs["early_stopping"] = self.early_stopping
        try:
            return BeamSearchParams(**kwargs)
        except SamplingParamError as exc:
            param = {"beam_width": "n", "max_tokens": max_tokens_field}.get(exc.param, exc.param)
            raise APIError(400, str(exc).replace(exc.param, param, 1), param,
                           "invalid_value") from None


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def _max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def _logprobs(self) -> tuple[int | None, str]:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs",
                           "invalid_value")
        if not self.logprobs:
            return None, "logprobs"
        return self.top_logprobs or 0, "top_logprobs"

    def check_supported(self) -> None:
        """Raises ``APIError`` 400 for a ``tool_choice`` the ``tools`` cannot meet."""
        choice = self.effective_tool_choice
        if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
            if not self.tools:
                raise APIError(400, "'tool_choice' needs 'tools'", "tool_choice",
                               "invalid_value")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if choice.function.name not in names:
                raise APIError(400, f"'tool_choice' names the function "
                               f"{choice.function.name!r}, which is not in 'tools' {names}",
                               "tool_choice", "invalid_value")
        if (choice not in ("none", "auto")
                and SamplingRequest.structured_outputs_params(self)[0] is not None):
            raise APIError(400, "a forced tool call cannot be combined with another output "
                           "constraint", "tool_choice", "invalid_value")

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: ``auto`` with tools, ``none`` without."""
        if not self.tools:
            return "none"
        return self.tool_choice if self.tool_choice is not None else "auto"

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """As ``SamplingRequest``'s, plus the grammar of a forced tool call
        (``tool_choice`` ``required`` or a named function)."""
        params, field = super().structured_outputs_params()
        choice = self.effective_tool_choice
        if params is not None or choice in ("none", "auto"):
            return params, field
        from aioengine.tools.constraint import tool_call_schema

        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        schema = tool_call_schema([t.function.model_dump(exclude_none=True)
                                   for t in self.tools or []],
                                  named, self.parallel_tool_calls is not False)
        return StructuredOutputsParams(json=schema), "tools"


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: PromptInput
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def _max_tokens(self) -> tuple[int | None, str]:
        # OpenAI's (and vLLM's) default for the legacy completions API.
        return (16 if self.max_tokens is None else self.max_tokens), "max_tokens"

    def _logprobs(self) -> tuple[int | None, str]:
        return self.logprobs, "logprobs"

    def check_supported(self) -> None:
        """Raises ``APIError`` 400 for features this server does not have."""
        if self.suffix:
            raise APIError(400, "'suffix' is not supported", "suffix", "unsupported")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError(400, "'best_of' must equal 'n' (no server-side best-of; with "
                           "'use_beam_search', 'n' is the beam width)", "best_of",
                           "unsupported")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "'echo' with 'logprobs' needs prompt logprobs, which are not "
                                "supported", "echo", "unsupported")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: strings and/or token-id lists.

        Raises:
            APIError: 400 for an empty prompt list.
        """
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "'prompt' must not be empty", "prompt", "invalid_value")
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM): either ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM)."""

    model: str | None = None
    tokens: list[int]


# -- responses ------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatLogprobEntry] | None = None


class FunctionCallOutput(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOutput


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _now() -> int:
    return int(time.time())


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class ChatCompletionStreamChoice(_Response):
    index: int
    # {"role": "assistant", "content": ""} first, then {"content": ...} or
    # {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}
    delta: dict[str, Any]
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


CompletionChunk = CompletionResponse  # same shape; OpenAI streams "text_completion" objects


class ModelQuantization(_Response):
    """How the served weights are stored: ``method`` is ``"gguf"`` (the file's own
    formats), ``"int8"``/``"int4"`` (quantized at load) or ``"none"``; ``weight_formats``
    counts tensors per GGML format name (``{"Q4_1": 210, "F32": 61, "Q8_0": 1}``)."""

    method: str
    weight_formats: dict[str, int]


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "aioengine"
    root: str | None = None
    max_model_len: int | None = None
    quantization: ModelQuantization | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str

