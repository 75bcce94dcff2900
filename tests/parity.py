"""The near-tie rule of DESIGN.md, shared by every greedy-parity test.

Token ids must be equal. Where two runs first differ, both runs' top-two
logprobs at that position must lie within 1e-3 of each other (a near-tie);
the comparison stops there and the tie is reported. Anything else fails.
"""

from __future__ import annotations

import os
from functools import lru_cache

NEAR_TIE = 1e-3


def top2_gap(top: list[float]) -> float:
    a, b = sorted(top, reverse=True)[:2]
    return a - b


def assert_greedy_parity(name: str, ours: list[int], ref: list[int],
                         ours_top2: list[list[float]], ref_top2: list[list[float]]) -> str | None:
    """Fail unless ``ours`` equals ``ref`` up to a near-tie; returns a report
    line when a near-tie was met, else None.

    ``*_top2[i]``: the two highest logprobs at output position i.
    """
    assert len(ours) == len(ref), f"{name}: lengths {len(ours)} != {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        gap_ours, gap_ref = top2_gap(ours_top2[i]), top2_gap(ref_top2[i])
        assert gap_ours < NEAR_TIE and gap_ref < NEAR_TIE, (
            f"{name}: token {i} differs ({a} vs {b}) and is no near-tie "
            f"(top-2 gaps {gap_ours:.2e} ours, {gap_ref:.2e} reference)\n"
            f"ours: {ours}\nref:  {ref}")
        report = f"{name}: near-tie at token {i} (gaps {gap_ours:.1e}, {gap_ref:.1e})"
        print(report)
        return report
    return None


@lru_cache(maxsize=1)
def hf_model():
    """HF transformers' own LlamaForCausalLM on the default GGUF, fp32: the oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    from aioengine.config import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int
              ) -> tuple[list[int], list[list[float]]]:
    """HF ``generate`` greedy tokens and per-step top-2 logprobs (no EOS stop)."""
    import torch

    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    top2 = [step[0].float().log_softmax(-1).topk(2).values.tolist() for step in out.logits]
    return tokens, top2
