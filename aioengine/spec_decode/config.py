"""``SpeculativeConfig``: vLLM's ``--speculative-config`` JSON, validated.

The keys are vLLM's (``method``, ``model``, ``num_speculative_tokens``,
``prompt_lookup_min``, ``prompt_lookup_max``, ``disable_by_batch_size``), so
a command line written for ``vllm serve`` works here::

    aioengine serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    aioengine serve --speculative-config '{"method": "draft_model", "model": "small.gguf",
                                           "num_speculative_tokens": 4}'

As in vLLM, a ``model`` with no ``method`` means ``draft_model``, and no
``model`` and no ``method`` means ``ngram``.

Some keys are ours. ``verify_token_cost`` drives dynamic speculation
(``spec_decode.dynamic``): each step, each request verifies only the drafts
whose expected tokens outweigh what their query rows add to the step, so a
request with low acceptance, or a big batch, speculates less or not at all.
``min_acceptance_rate``, ``window`` and ``cooldown_steps`` drive a coarser
off-switch in the scheduler (``spec_decode.scheduling``), off by default: a
request whose recent drafts are mostly rejected stops drafting for a while.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
# vLLM's defaults when neither bound is given (vllm/config/speculative.py).
DEFAULT_PROMPT_LOOKUP = 5
# Running requests at which drafting stops (ours; vLLM never stops by default).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# One more query token in a step, as a fraction of a one-token decode step: on the
# 2-core dev CPU a 4-token verification step costs about 1.7 decode steps and a
# 16-request decode step about 5.4 (bench/README.md, speculative decoding).
DEFAULT_VERIFY_TOKEN_COST = 0.25


@dataclass(frozen=True)
class SpeculativeConfig:
    """How requests speculate.

    Attributes:
        method: ``"ngram"`` (prompt lookup: propose what followed the last
            n tokens where they occurred before in the prompt or output) or
            ``"draft_model"`` (a smaller model with the target's tokenizer
            proposes autoregressively, ``spec_decode.draft_model``). None:
            ``draft_model`` when ``model`` is given, else ``ngram`` (vLLM).
        model: the draft model's path (HF folder or GGUF file), for
            ``draft_model`` only; it must exist.
        num_speculative_tokens: most draft tokens verified per request and step.
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths tried, longest
            first; one given alone sets both, neither gives 5 and 5 (vLLM).
        disable_by_batch_size: no request drafts in a step when this many or
            more requests are running (vLLM's key); 0 never disables. A big
            batch is compute-bound and gains little from verification: on the
            2-core dev machine 16 n-gram streams ran at 0.89x of no speculation
            with no threshold. Our default is ``DEFAULT_DISABLE_BY_BATCH_SIZE``
            (8; vLLM's is never): 8 decoding streams already fill the CPU's
            matmul tiles (``bench/README.md``: 8 streams give about 5x the
            batch-1 tokens/s), so drafting would multiply the step's rows.
        verify_token_cost: the dynamic rule's cost model (``spec_decode.dynamic``):
            a step of ``N`` query tokens costs ``(1 - c) + c N`` one-token decode
            steps. A draft is verified only when its probability of being
            accepted (from the request's recent acceptance) exceeds ``c`` times
            the step's expected tokens over its cost: about ``c`` at batch 1,
            0.84 at 16 requests with ``c = 0.25``. 0 verifies every proposal
            (no dynamic rule). Our default, 0.25, is the dev CPU's; a GPU's
            small batches are bound by reading the weights, so a few
            hundredths suit it.
        min_acceptance_rate: a request whose acceptance over its last
            ``window`` draft tokens falls below this stops drafting for
            ``cooldown_steps`` decode steps (doubling each time it happens
            again); 0 (the default) disables the off-switch: the dynamic
            rule already stops a request's drafts while they are unlikely to
            be accepted, and resumes them as soon as they would be (its
            proposals are scored even when not verified), where a cooldown
            would also stop the drafts of a request that just began copying
            (measured: a 7-token n-gram proposal tripped it in the middle of
            code being repeated).
        window: draft tokens the acceptance rate is measured over.
        cooldown_steps: first pause, in decode steps.
    """

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    verify_token_cost: float = DEFAULT_VERIFY_TOKEN_COST
    min_acceptance_rate: float = 0.0
    window: int = 16
    cooldown_steps: int = 16

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "ngram" if self.model is None else "draft_model")
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError('speculative method "draft_model" needs "model": the draft '
                                 "model's path")
            if not os.path.exists(self.model):
                raise ValueError(f"speculative draft model {self.model!r} does not exist")
        elif self.model is not None:
            raise ValueError(f'speculative "model" is for method "draft_model", not '
                             f"{self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got "
                             f"{self.num_speculative_tokens!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if not (isinstance(lo, int) and lo >= 1):
            raise ValueError(f"prompt_lookup_min must be an integer >= 1, got {lo!r}")
        if not (isinstance(hi, int) and hi >= lo):
            raise ValueError(f"prompt_lookup_max must be an integer >= prompt_lookup_min "
                             f"({lo}), got {hi!r}")
        if self.disable_by_batch_size < 0:
            raise ValueError("disable_by_batch_size must be >= 0")
        if (not isinstance(self.verify_token_cost, (int, float))
                or not 0.0 <= self.verify_token_cost < 1.0):
            raise ValueError(f"verify_token_cost must be in [0, 1), got "
                             f"{self.verify_token_cost!r}")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError(f"min_acceptance_rate must be in [0, 1], got "
                             f"{self.min_acceptance_rate}")
        if self.window < 1 or self.cooldown_steps < 1:
            raise ValueError("window and cooldown_steps must be >= 1")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        """Build from vLLM's dict; raises ValueError for an unknown key."""
        if not isinstance(d, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative config key(s) {unknown}; known: "
                             f"{sorted(known)}")
        return cls(**d)

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None
              ) -> SpeculativeConfig | None:
        """A JSON string (the CLI flag), a dict (``LLM(speculative_config=...)``),
        a config, or None (no speculation). Raises ValueError for bad JSON."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        return cls.from_dict(value)


def check_draft_model(target_path: str, draft_path: str) -> None:
    """Refuse a draft model that cannot propose for the target: its vocabulary
    (embedding rows, ``vocab_size``) and its tokenizer's token-to-id map must be
    the target's, or draft token ids would mean other tokens (and the draft
    distributions ``q`` another vocabulary). Torch-free: it runs in the engine
    process before the worker starts; the result is cached per file version.

    Raises:
        ValueError: one line naming both sizes, or the first differing token.
    """
    if not os.path.exists(target_path):
        return  # the target's own check reports it
    _check_draft_model(target_path, draft_path, _file_version(target_path),
                       _file_version(draft_path))


def _file_version(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=8)
def _check_draft_model(target_path: str, draft_path: str, *_versions: object) -> None:
    from aioengine.models.loader import load_hf_config
    from aioengine.tokenizer import load_tokenizer

    try:
        sizes = [int(load_hf_config(p).vocab_size) for p in (target_path, draft_path)]
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative draft model {draft_path!r} cannot be read: "
                         f"{str(exc).splitlines()[0]}") from None
    if sizes[0] != sizes[1]:
        raise ValueError(f"speculative draft model {draft_path!r} has a vocabulary of "
                         f"{sizes[1]} tokens, the target {sizes[0]}: the draft needs the "
                         f"target's tokenizer")
    target, draft = (load_tokenizer(p).get_vocab() for p in (target_path, draft_path))
    if target != draft:
        differ = sorted(set(target.items()) ^ set(draft.items()), key=lambda kv: kv[1])[0]
        raise ValueError(f"speculative draft model {draft_path!r} has another tokenizer than "
                         f"the target (token {differ[0]!r} is id {target.get(differ[0])} in "
                         f"the target, {draft.get(differ[0])} in the draft)")
