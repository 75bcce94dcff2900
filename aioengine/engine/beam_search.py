"""Beam search with Hugging Face transformers' rules, independent of how beams are run.

``BeamSearchState`` is one prompt's search: give it, for each running beam, the
beam's best next tokens and their logprobs; it returns which beams continue with
which tokens (the caller forks the survivors' KV blocks and frees the losers'),
and, once done, the finished hypotheses best first. The rules are those of
``transformers.GenerationMixin._beam_search`` (v4.50+, the vectorised rewrite of
``BeamSearchScorer``), so ``generate(num_beams=k, num_return_sequences=k,
do_sample=False, length_penalty=..., early_stopping=...)`` is the oracle:

- each step, every running beam's continuations are scored by cumulative logprob
  and the best ``2 * k`` kept (``max(2, 1 + number of EOS ids) * k``), ties to the
  lower ``beam_index * vocab + token``;
- candidates that end (EOS, or the ``max_tokens``-th token) leave the running set;
  the ``k`` best that do not end run on, best first;
- an ending candidate among the first ``k`` becomes a hypothesis scored
  ``cum_logprob / generated_len ** length_penalty`` (EOS counted), and the ``k``
  best hypotheses are kept, unless all ``k`` are in and ``early_stopping`` is True,
  or the search can no longer improve;
- "can no longer improve" (sticky): all ``k`` hypotheses are in and the best running
  beam's cumulative logprob over ``generated_len ** length_penalty`` (over
  ``max_tokens ** length_penalty`` when ``early_stopping == "never"`` and
  ``length_penalty > 0``) is not above the worst hypothesis' score;
- the search ends when it can no longer improve, when all ``k`` hypotheses are in
  and ``early_stopping`` is True, or at ``max_tokens``.

The first step has a single running beam (the prompt), as HF's ``-1e9`` initial
scores on beams 1..k-1 make it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aioengine.sampling_params import SamplingParamError

MAX_BEAM_WIDTH = 128  # as SamplingParams' bound on n

if TYPE_CHECKING:
    from aioengine.core.scheduler import Scheduler
    from aioengine.request import Request


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` plus HF's ``early_stopping``.

    Attributes:
        beam_width: beams kept per step, and the number of sequences returned (k).
        max_tokens: most new tokens per beam.
        ignore_eos: EOS does not end a beam.
        temperature: must be 0: beams are ranked by the model's own logprobs (HF's
            ``do_sample=False``).
        length_penalty: exponent on the generated length dividing a finished beam's
            cumulative logprob; > 0 favours longer outputs (HF's default 1.0).
        include_stop_str_in_output: accepted for vLLM compatibility (beam search has
            no stop strings).
        early_stopping: True, False (HF's default) or "never", as in HF's
            ``GenerationConfig.early_stopping``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    @property
    def n(self) -> int:
        """Sequences returned, as ``SamplingParams.n``."""
        return self.beam_width

    def __post_init__(self) -> None:
        # Bounded as SamplingParams.n: every beam returns its top 2 * beam_width
        # logprobs each step, so a huge width overflows the worker's output ring (or
        # asks torch.topk for more tokens than the vocabulary) and kills the worker.
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise SamplingParamError("beam_width", f"beam_width must be an integer in "
                                                   f"[1, {MAX_BEAM_WIDTH}], got "
                                                   f"{self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise SamplingParamError("max_tokens", f"max_tokens must be an integer >= 1, got "
                                                   f"{self.max_tokens!r}")
        if self.temperature != 0:
            raise SamplingParamError(
                "temperature", "beam search ranks beams by the model's logprobs and supports "
                f"only temperature 0, got {self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(
                self.length_penalty, bool) or not math.isfinite(self.length_penalty):
            raise SamplingParamError("length_penalty", "length_penalty must be a finite number, "
                                                       f"got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never") or not isinstance(
                self.early_stopping, (bool, str)):
            raise SamplingParamError("early_stopping", "early_stopping must be true, false or "
                                                       f"\"never\", got {self.early_stopping!r}")


@dataclass
class Beam:
    """A running beam or a finished hypothesis.

    Attributes:
        tokens: generated token ids (a finished beam's EOS included).
        cum_logprob: sum of the tokens' logprobs.
        score: ``cum_logprob / len(tokens) ** length_penalty`` once finished.
        finish_reason: "stop" (EOS) or "length" once finished, else None.
    """

    tokens: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    score: float | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchSequence:
    """One returned beam, as vLLM's: ``tokens`` holds prompt and output."""

    tokens: list[int]
    cum_logprob: float
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list = field(default_factory=list)


@dataclass
class BeamSearchOutput:
    """vLLM's ``BeamSearchOutput``: the best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearchState:
    """One prompt's beam search (see the module docstring for the rules).

    Args:
        params: the search settings.
        eos_token_ids: ids that end a beam (unless ``params.ignore_eos``).
    """

    def __init__(self, params: BeamSearchParams, eos_token_ids: set[int] | frozenset[int]
                 ) -> None:
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.running: list[Beam] = [Beam()]
        self.finished: list[Beam] = []  # best first, at most beam_width
        self.num_generated = 0
        self.done = False
        self._improvable = True

    @property
    def num_candidates(self) -> int:
        """Continuations kept per step, and the top logprobs each beam must supply."""
        return max(2, 1 + len(self.eos_token_ids)) * self.params.beam_width

    def step(self, top_logprobs: list[list[tuple[int, float]]]) -> list[tuple[int, int]]:
        """Advance one token.

        Args:
            top_logprobs: for each beam of ``self.running`` in order, at least its
                ``num_candidates`` most likely next tokens as ``(token_id, logprob)``
                (more is fine; fewer only if the vocabulary is that small).

        Returns:
            The next running beams as ``(index into the previous running list,
            token)``, best first; ``self.running`` is updated to match. Empty once
            ``self.done``.

        Raises:
            ValueError: the search is done, or one list per running beam is not given.
        """
        if self.done:
            raise ValueError("the beam search is done")
        if len(top_logprobs) != len(self.running):
            raise ValueError(f"{len(self.running)} running beams, got {len(top_logprobs)} "
                             "candidate lists")
        p, k = self.params, self.params.beam_width
        candidates = [(beam.cum_logprob + lp, i, token)
                      for i, (beam, tops) in enumerate(zip(self.running, top_logprobs))
                      for token, lp in tops]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[:self.num_candidates]
        length = self.num_generated + 1
        at_max = length >= p.max_tokens
        ends = [at_max or token in self.eos_token_ids for _, _, token in candidates]

        if self._improvable and not (len(self.finished) == k and p.early_stopping is True):
            new = [Beam(self.running[i].tokens + [token], score,
                        score / length ** p.length_penalty,
                        "stop" if token in self.eos_token_ids else "length")
                   for (score, i, token), end in zip(candidates[:k], ends) if end]
            if new:  # sorted() is stable: an earlier hypothesis wins a tie
                self.finished = sorted(self.finished + new, key=_neg_score)[:k]

        survivors = [(i, token, score) for (score, i, token), end in zip(candidates, ends)
                     if not end][:k]
        self.running = [Beam(self.running[i].tokens + [token], score)
                        for i, token, score in survivors]
        self.num_generated = length
        if self.running and len(self.finished) == k:
            best_len = (p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0
                        else length)
            best_possible = self.running[0].cum_logprob / best_len ** p.length_penalty
            self._improvable = self._improvable and best_possible > self.finished[-1].score
        self.done = (not self._improvable or all(ends) or not self.running
                     or (len(self.finished) == k and p.early_stopping is True))
        if self.done:
            self.running = []
            return []
        return [(i, token) for i, token, _ in survivors]


def _neg_score(beam: Beam) -> float:
    return -(beam.score if beam.score is not None else -math.inf)


class BeamSearchGroup:
    """One beam-search request on the engine: its beams are ``Request``s whose KV
    blocks are shared through forks (PagedAttention §4.4).

    Each step every running beam computes one token and returns its top
    ``num_candidates`` logprobs; the token the worker sampled is taken back
    (``Request.pop_output_token``), and the beam waits, holding its blocks, until
    every beam of the group has its candidates. Then ``BeamSearchState.step``
    picks the survivors: a beam picked once continues itself with the chosen
    token; each further pick forks it (``Scheduler.add_forked_request``: the new
    beam shares every block, the partial last one included, copied on the first
    write); beams not picked are freed.

    Args:
        request_id: the caller's id; beams are ``{request_id}#beam{n}``.
        first: the beam that prefills the prompt.
        params: the search settings.
        eos_token_id: the model's EOS id, or None.
        make_request: ``(request_id, output_token_ids) -> Request``: a new beam
            with this group's prompt and settings.
    """

    def __init__(self, request_id: str, first: Request, params: BeamSearchParams,
                 eos_token_id: int | None,
                 make_request: Callable[[str, list[int]], Request]) -> None:
        self.request_id = request_id
        self.make_request = make_request
        self.params = params
        self.state = BeamSearchState(params, set() if eos_token_id is None else {eos_token_id})
        self.beams = [first]
        self.prompt_token_ids = list(first.prompt_token_ids)
        self._pending: dict[str, list[tuple[int, float]]] = {}
        self._next_beam = 1
        self.num_cached_tokens = -1  # the prompt's prefix-cache hit, once known

    @property
    def beam_ids(self) -> list[str]:
        return [b.request_id for b in self.beams]

    def accept(self, request: Request, logprobs: list[tuple[int, float]] | None,
               block_size: int) -> None:
        """Take one beam's step result: its sampled token goes back, its
        candidates are kept until the group steps."""
        request.pop_output_token(block_size)
        self._pending[request.request_id] = logprobs or []
        if self.num_cached_tokens < 0 <= request.num_cached_tokens:
            self.num_cached_tokens = request.num_cached_tokens

    def ready(self) -> bool:
        return not self.state.done and all(b.request_id in self._pending for b in self.beams)

    def advance(self, scheduler: Scheduler) -> bool:
        """Step the search once every beam has its candidates.

        Args:
            scheduler: owner of the beams (forks and frees them).

        Returns:
            True once the search is done (every beam freed; ``finished`` holds
            the results).
        """
        from aioengine.request import RequestStatus

        candidates = []
        for beam in self.beams:
            best: dict[int, float] = {}
            for token, lp in self._pending.pop(beam.request_id):
                best.setdefault(token, lp)
            candidates.append(list(best.items()))
        picks = self.state.step(candidates)
        if self.state.done:
            scheduler.finish_requests(self.beam_ids, RequestStatus.FINISHED_STOPPED)
            self.beams = []
            return True
        bases = [list(b.output_token_ids) for b in self.beams]
        used: set[int] = set()
        beams = []
        for parent_index, token in picks:
            parent = self.beams[parent_index]
            if parent_index not in used:
                used.add(parent_index)
                parent.append_output_token_ids([token])
                parent.engine_chose_tokens = True
                beams.append(parent)
                continue
            child = self.make_request(f"{self.request_id}#beam{self._next_beam}",
                                 bases[parent_index] + [token])
            self._next_beam += 1
            scheduler.add_forked_request(parent, child)
            beams.append(child)
        losers = [b.request_id for i, b in enumerate(self.beams) if i not in used]
        scheduler.finish_requests(losers, RequestStatus.FINISHED_ABORTED)
        self.beams = beams
        return False

    @property
    def finished(self) -> list[Beam]:
        return self.state.finished
