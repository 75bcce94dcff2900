"""Output processing: token ids from ``EngineCore`` into ``RequestOutput``s.

The back of the engine (vLLM v1's ``OutputProcessor``): per sample it
detokenizes incrementally, matches stop strings (holding back text that may
still become one), and assembles each step's cumulative and delta text into
``RequestOutput``s, gathered per parent request (``parallel_sampling``). A stop
string ends a sample here; the caller then finishes that request in the core
(``OutputProcessorOutput.request_ids_to_finish``), before the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aioengine.engine.core import EngineCoreOutput, EngineCoreOutputs
from aioengine.engine.detokenizer import IncrementalDetokenizer
from aioengine.engine.parallel_sampling import ParentRequest
from aioengine.sampling_params import CompletionOutput, RequestOutput


@dataclass
class OutputProcessorOutput:
    """One step's results.

    Attributes:
        request_outputs: one per parent request that progressed.
        request_ids_to_finish: child requests a stop string ended, still
            running in the core (finish them with ``FINISHED_STOPPED``).
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    request_ids_to_finish: list[str] = field(default_factory=list)


@dataclass
class _SampleState:
    parent: ParentRequest
    index: int
    detokenizer: IncrementalDetokenizer


class OutputProcessor:
    """Detokenization, stop strings and ``RequestOutput``s of every live request.

    Args:
        tokenizer: the model's HF tokenizer (its fast ``backend_tokenizer``
            decodes the stream).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._backend_tokenizer = tokenizer.backend_tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self._samples: dict[str, _SampleState] = {}
        self.num_requests_finished = 0
        # Live parents with stop strings: only they make ``process_outputs``
        # finish requests in the core (``request_ids_to_finish``).
        self._num_with_stop = 0

    @property
    def can_finish_requests(self) -> bool:
        """Whether ``process_outputs`` may end requests the core still runs (a live
        request has stop strings); when False, a step's outputs may be processed
        after the next step is scheduled without changing what either does."""
        return self._num_with_stop > 0

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents

    def add_request(self, parent: ParentRequest) -> None:
        """Track a parent request and its children.

        Raises:
            ValueError: ``parent.request_id`` is already in use.
        """
        if parent.request_id in self.parents:
            raise ValueError(f"request id {parent.request_id!r} is already in use")
        self.parents[parent.request_id] = parent
        params = parent.params
        self._num_with_stop += bool(params.stop)
        for index, child in enumerate(parent.child_requests):
            self._samples[child.request_id] = _SampleState(
                parent,
                index,
                IncrementalDetokenizer(
                    self._backend_tokenizer,
                    params.stop,
                    params.include_stop_str_in_output,
                    params.skip_special_tokens,
                    min_tokens=params.min_tokens,
                ),
            )

    def abort_request(self, request_id: str) -> list[str] | None:
        """Forget a parent request; returns its child ids (to abort in the core),
        or None when it is unknown."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        self._num_with_stop -= bool(parent.params.stop)
        for child_id in parent.child_request_ids:
            self._samples.pop(child_id, None)
        return parent.child_request_ids

    def process_outputs(self, core_outputs: EngineCoreOutputs) -> OutputProcessorOutput:
        """Apply one step's tokens; one ``RequestOutput`` per parent that produced
        something (listing only the samples that changed)."""
        result = OutputProcessorOutput()
        changed: dict[str, tuple[ParentRequest, list[int]]] = {}
        for core_output in core_outputs.outputs:
            state = self._samples.get(core_output.request_id)
            if state is None:
                continue  # aborted while the step ran
            parent = state.parent
            if parent.num_cached_tokens < 0 and core_output.num_cached_tokens >= 0:
                parent.num_cached_tokens = core_output.num_cached_tokens
            if not core_output.new_token_ids and core_output.finish_reason is None:
                continue  # a prompt chunk: nothing sampled yet
            if self._apply(state, core_output):
                result.request_ids_to_finish.append(core_output.request_id)
            changed.setdefault(parent.request_id, (parent, []))[1].append(state.index)
        for parent, indices in changed.values():
            output = parent.make_request_output(indices)
            result.request_outputs.append(output)
            if output.finished:
                self._release(parent)
        return result

    def _apply(self, state: _SampleState, core_output: EngineCoreOutput) -> bool:
        """Add one step's tokens to a sample; True when a stop string ended it
        while the core still runs it."""
        detokenizer = state.detokenizer
        completion: CompletionOutput = state.parent.completions[state.index]
        completion.delta_token_ids, completion.delta_text = [], ""
        last = len(core_output.new_token_ids) - 1
        stopped = False
        if last < 0:  # finished without a token (one its grammar forbade was dropped)
            completion.delta_text = detokenizer.get_delta(True)
            completion.text += completion.delta_text
            completion.finish_reason = core_output.finish_reason
            completion.stop_reason = core_output.stop_reason
            return False
        for k, token in enumerate(core_output.new_token_ids):
            stopped = detokenizer.update(token)
            completion.delta_token_ids.append(token)
            completion.token_ids.append(token)
            if core_output.new_logprobs is not None:
                completion.logprobs = (completion.logprobs or []) + [
                    dict(core_output.new_logprobs[k])
                ]
            finished = stopped or (k == last and core_output.finish_reason is not None)
            delta = detokenizer.get_delta(finished)
            completion.delta_text += delta
            completion.text += delta
            if finished:
                # A stop string completed by the token that also reached
                # max_tokens is a stop, as vLLM reports it.
                completion.finish_reason = "stop" if stopped else core_output.finish_reason
                completion.stop_reason = (
                    detokenizer.stop_reason if stopped else core_output.stop_reason
                )
                break
        return stopped and core_output.finish_reason is None

    def _release(self, parent: ParentRequest) -> None:
        if self.parents.pop(parent.request_id, None) is not None:
            self._num_with_stop -= bool(parent.params.stop)
        for child_id in parent.child_request_ids:
            self._samples.pop(child_id, None)
        self.num_requests_finished += 1

    def fail_all(self, message: str) -> tuple[list[RequestOutput], list[str]]:
        """End every request with ``error`` set (worker crash, shutdown).

        Returns:
            A final ``RequestOutput`` per parent (every sample, finish reason
            ``abort`` where it had none), and every child id to abort in the core.
        """
        outputs, child_ids = [], []
        for parent in list(self.parents.values()):
            child_ids += self.abort_request(parent.request_id) or []
            for c in parent.completions:
                c.finish_reason = c.finish_reason or "abort"
                c.delta_text, c.delta_token_ids = "", []
            outputs.append(parent.make_request_output(list(range(parent.n)), error=message))
        return outputs, child_ids
