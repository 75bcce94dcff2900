"""Typed step messages between the engine and the worker (msgpack via msgspec).

Each message is a tagged, array-like ``msgspec.Struct``: a one-field tag and
positional fields, so a decode step for 32 requests is a few hundred bytes.
Deltas only: a request's prompt, sampling settings and block table cross once
(``NewRequestData``); afterwards only its new block ids and token counts do
(``CachedRequestData``). No pickle anywhere.
"""

from __future__ import annotations

import msgspec


class SamplingMetadata(msgspec.Struct, array_like=True):
    """What the worker's sampler needs of one request's SamplingParams.

    ``seed`` is always set (the engine draws one when the request gave none) so
    every request samples from its own generator. ``logprobs`` -1 means none.
    ``stop_token_ids`` holds EOS too unless ``ignore_eos``; they are masked
    until ``min_tokens`` tokens were generated.
    """

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    logprobs: int
    min_tokens: int
    stop_token_ids: list[int]
    logit_bias: list[tuple[int, float]]


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the worker has not seen: all of its tokens and its block table."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingMetadata
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, array_like=True):
    """A request the worker knows: blocks added since last step.

    When ``resumed`` is true the request was preempted and ``new_block_ids``
    is its whole new block table (replacing the old one). ``cow_block_ids``
    lists ``(block table index, new block id)`` entries that copy-on-write
    replaced this step (the copies are in ``SchedulerOutput.copy_blocks``).
    ``new_token_ids``, when not empty, are the tokens at positions
    ``num_computed_tokens..`` as the engine chose them, replacing what the
    worker sampled (beam search keeps continuations it did not sample).
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed: bool = False
    cow_block_ids: list[tuple[int, int]] = msgspec.field(default_factory=list)
    new_token_ids: list[int] = msgspec.field(default_factory=list)


class SchedulerOutput(msgspec.Struct, array_like=True, tag=1):
    """One step's work. ``num_scheduled_tokens`` lists new requests first, then
    cached ones, in the order given.

    ``grammar_bitmask`` (structured outputs) is the packed
    ``int32 [len(structured_output_request_ids), ceil(vocab / 32)]`` mask as
    the grammar library fills it, as raw bytes: row ``i`` says which tokens
    ``structured_output_request_ids[i]`` may sample this step (bit ``j % 32``
    of word ``j // 32`` for token ``j``). Only constrained requests that
    sample in this step have a row; a step without any carries ``None``.

    ``scheduled_spec_decode_tokens`` (speculative decoding, vLLM's name) maps a
    request to the draft tokens scheduled after its last token: its
    ``num_scheduled_tokens`` entry counts them, the worker scores them all in
    this step's forward and verifies them (``spec_decode.verifier``).
    """

    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: list[int]
    finished_req_ids: list[str]
    preempted_req_ids: list[str]
    structured_output_request_ids: list[str] = msgspec.field(default_factory=list)
    grammar_bitmask: bytes | None = None
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    copy_blocks: list[tuple[int, int]] = msgspec.field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    def req_ids(self) -> list[str]:
        return [r.req_id for r in self.scheduled_new_reqs] + [
            r.req_id for r in self.scheduled_cached_reqs
        ]


class ModelRunnerOutput(msgspec.Struct, array_like=True, tag=2):
    """Sampled tokens of one step, aligned with ``SchedulerOutput.req_ids()``.

    ``sampled_token_ids[i]`` is -1 for a request whose prompt is still being
    prefilled (nothing sampled). ``logprobs[i]``, when requested, holds the
    sampled token's logprob first, then the top alternatives, as
    ``(token_id, logprob)`` pairs. Times are in seconds, measured in the worker.

    ``idle_time`` is how long the worker waited between its previous step's end
    and this step's start (reading this message included): the engine-side time
    on the step's critical path, which async scheduling removes.

    Speculative decoding: ``num_accepted_tokens[i]`` of request ``i``'s
    scheduled drafts were accepted, so it emits those drafts and then
    ``sampled_token_ids[i]``; ``spec_token_ids[i]`` are its drafts for the next
    step (empty: none). Both None when the worker does not speculate.
    """

    step_id: int
    sampled_token_ids: list[int]
    logprobs: list[list[tuple[int, float]] | None] | None
    forward_time: float
    sample_time: float
    num_accepted_tokens: list[int] | None = None
    spec_token_ids: list[list[int]] | None = None
    idle_time: float = 0.0


class WorkerReady(msgspec.Struct, array_like=True, tag=3):
    """Handshake from the worker once weights and KV cache are in place."""

    num_blocks: int
    block_size: int
    max_model_len: int
    weight_bytes: int
    load_time: float


class Shutdown(msgspec.Struct, array_like=True, tag=4):
    """Ask the worker to exit cleanly."""


class WorkerError(msgspec.Struct, array_like=True, tag=5):
    """The worker failed a step or its start; ``message`` is the traceback."""

    message: str


class LoadModel(msgspec.Struct, array_like=True, tag=6):
    """Tell a standby worker (started with its imports done, no model yet) to load
    the model and answer ``WorkerReady``: how a crashed worker is replaced."""


ToWorker = SchedulerOutput | Shutdown | LoadModel
FromWorker = ModelRunnerOutput | WorkerReady | WorkerError

_encoder = msgspec.msgpack.Encoder()
_to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
_from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_worker(data: bytes | memoryview) -> SchedulerOutput | Shutdown | LoadModel:
    return _to_worker_decoder.decode(data)


def decode_from_worker(data: bytes | memoryview) -> ModelRunnerOutput | WorkerReady | WorkerError:
    return _from_worker_decoder.decode(data)
