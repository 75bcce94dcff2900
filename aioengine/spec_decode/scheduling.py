"""The scheduler's side of speculative decoding: which drafts run, and what is undone.

Each step the worker returns drafts for the requests it sampled
(``ModelRunnerOutput.spec_token_ids``); the scheduler keeps them on the
request (``Request.spec_token_ids``) and, when the request next decodes,
schedules its last token plus ``num_spec_tokens`` of them. After the step
``num_computed_tokens`` moves back over the rejected drafts and the blocks
allocated only for them are freed (``KVCacheManager.rollback``), so the
request's blocks, hashes and counters are those of a run that never
speculated.

Drafts are never worth a preemption: when blocks do not suffice for the
drafts, the request is scheduled without them.

The adaptive off-switch: each request measures its acceptance over its last
``window`` draft tokens; below ``min_acceptance_rate`` it stops drafting for
``cooldown_steps`` decode steps, doubled at each further trip, so a workload
where drafts are wrong (open-ended chat) costs little more than no
speculation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from aioengine.request import Request
from aioengine.spec_decode.config import SpeculativeConfig


@dataclass
class SpecDecodingStats:
    """Cumulative counters, vLLM's ``spec_decode`` metrics.

    Attributes:
        num_drafts: verifications of at least one draft token.
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: draft tokens accepted.
        num_accepted_tokens_per_pos: accepted tokens by draft position.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: 1 + accepted / drafts (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft:
            per_pos.extend([0] * (num_draft - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1


class RequestSpecState:
    """One request's recent acceptance and its cool-down (the adaptive off-switch)."""

    def __init__(self) -> None:
        self.recent: deque[tuple[int, int]] = deque()
        self.recent_drafted = 0
        self.recent_accepted = 0
        self.cooldown = 0
        self.num_trips = 0


class SpecDecodeScheduler:
    """Draft selection, rollback bookkeeping and statistics for the ``Scheduler``.

    Args:
        config: the speculative settings.
        max_model_len: context length in tokens.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats()
        self._states: dict[str, RequestSpecState] = {}

    @staticmethod
    def can_speculate(request: Request) -> bool:
        """Whether verification covers this request's sampling: no grammar,
        no logprobs, no penalties, past ``min_tokens``."""
        p = request.sampling_params
        return (request.structured_output_request is None and p.logprobs is None
                and not p.presence_penalty and not p.frequency_penalty
                and p.repetition_penalty == 1.0
                and request.num_output_tokens >= p.min_tokens)

    def num_spec_tokens(self, request: Request, budget: int, num_running: int) -> int:
        """Drafts to schedule for ``request`` this step (0: a plain decode).

        Only a request in decode (one token to compute) drafts, never past
        ``max_tokens`` or the context (the bonus token needs room too), within
        the step's token ``budget``.
        """
        drafts = request.spec_token_ids
        if not drafts or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        cfg = self.config
        if cfg.disable_by_batch_size and num_running >= cfg.disable_by_batch_size:
            return 0
        state = self._states.get(request.request_id)
        if state is not None and state.cooldown > 0:
            state.cooldown -= 1
            return 0
        if not self.can_speculate(request):
            return 0
        room = min(request.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens) - 1
        return max(0, min(len(drafts), cfg.num_speculative_tokens, room, budget - 1))

    def observe(self, request: Request, num_draft: int, num_accepted: int) -> None:
        """Count one verification and update the request's off-switch."""
        self.stats.observe(num_draft, num_accepted)
        cfg = self.config
        if cfg.min_acceptance_rate <= 0:
            return
        state = self._states.setdefault(request.request_id, RequestSpecState())
        state.recent.append((num_draft, num_accepted))
        state.recent_drafted += num_draft
        state.recent_accepted += num_accepted
        while state.recent and state.recent_drafted - state.recent[0][0] >= cfg.window:
            d, a = state.recent.popleft()
            state.recent_drafted -= d
            state.recent_accepted -= a
        if (state.recent_drafted >= cfg.window
                and state.recent_accepted < cfg.min_acceptance_rate * state.recent_drafted):
            state.cooldown = cfg.cooldown_steps << min(state.num_trips, 6)
            state.num_trips += 1
            state.recent.clear()
            state.recent_drafted = state.recent_accepted = 0

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
