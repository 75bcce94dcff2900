"""Speculative decoding: n-gram drafts verified exactly by the target model.

- ``config``: ``SpeculativeConfig`` (vLLM's ``--speculative-config`` keys);
- ``ngram_proposer``: prompt-lookup drafts;
- ``rejection_sampler``: verification that keeps the target's distribution;
- ``verifier``: the worker side (draft positions' logits, verification,
  next drafts).
"""

from aioengine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
