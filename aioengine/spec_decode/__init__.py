"""Speculative decoding: n-gram or draft-model drafts verified exactly by the target model.

- ``config``: ``SpeculativeConfig`` (vLLM's ``--speculative-config`` keys);
- ``ngram_proposer``: prompt-lookup drafts;
- ``draft_model``: drafts from a smaller model in the same worker;
- ``dynamic``: how many drafts each request verifies per step (expected gain
  against the step's cost);
- ``scheduling``: the scheduler's side (drafts scheduled, rollback, metrics);
- ``rejection_sampler``: verification that keeps the target's distribution;
- ``verifier``: the worker side (draft positions' logits, verification,
  next drafts).
"""

from aioengine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
