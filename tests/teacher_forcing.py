"""Teacher-forced next-token agreement and perplexity of a fast numeric path against
the exact one, on the default model (issue 15's rule for a default: both within 1%).

Used by tests/test_quant_amx.py (the bf16 AMX GEMM, 16 rows a step) and
tests/test_q8_activations.py (int8 activations, 2 rows a step). The recipe: the exact
path's greedy continuation of each prompt (64 tokens), then each path's log-softmax at
every position of those sequences, teacher-forced through the decode step; agreement
counts the generated positions whose argmax is the same; perplexity is taken on
``TEXT``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. "
        "Within a few decades printing shops had spread to more than two hundred cities "
        "across Europe, and the cost of books fell so far that reading, once the privilege "
        "of monks and nobles, became common among merchants and craftsmen. Scholars could "
        "now compare identical copies of a text, which changed how knowledge was checked, "
        "argued over and passed on.")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "The three primary colors are", "Water boils at", "In 1969, the first",
           "A good way to learn a language is", "The largest planet in our solar system",
           "To make a cup of tea,", "Photosynthesis is the process", "import numpy as np\n",
           "The quick brown fox", "Dear hiring manager,", "Rain forms when",
           "The sum of two and two is", "My favourite book is"]


def teacher_forced(llm, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, the log-softmax ``[len - 1, vocab]`` of each next token, running all
    the sequences side by side, one token each a step, through the decode path (its GEMM
    has as many rows as sequences still running), each in its own cache blocks of
    ``llm``'s in-process runner."""
    from aioengine.models.llama import AttentionMetadata

    runner = llm.executor.runner
    bs = runner.block_size
    per_seq = -(-max(map(len, seqs)) // bs)
    tables = torch.arange(len(seqs) * per_seq, dtype=torch.int32).view(len(seqs), per_seq)
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    with torch.inference_mode():
        for t in range(max(map(len, seqs)) - 1):
            live = [i for i, s in enumerate(seqs) if t < len(s) - 1]
            attn = AttentionMetadata(
                slot_mapping=torch.tensor([int(tables[i, t // bs]) * bs + t % bs for i in live]),
                block_tables=tables[live, :t // bs + 1].contiguous(),
                cu_seqlens_q=torch.arange(len(live) + 1, dtype=torch.int32),
                seq_lens=torch.full((len(live),), t + 1, dtype=torch.int32), max_seqlen_q=1,
                max_seqlen_k=t + 1)
            hidden = runner.model.forward(torch.tensor([seqs[i][t] for i in live]),
                                          torch.full((len(live),), t), runner.kv_cache, attn)
            logp = runner.model.compute_logits(hidden).log_softmax(-1)
            for j, i in enumerate(live):
                rows[i].append(logp[j])
    return [torch.stack(r) for r in rows]


def default_llm():
    """The default model in this process, one torch thread (the caller sets it, e.g.
    conftest's ``one_thread``): ~1,500 steps of 1-16 rows, and on a shared 2-core
    machine a 2-thread step waits whenever the other thread is descheduled."""
    from aioengine import LLM

    return LLM(executor="inproc", max_num_seqs=16, num_threads=1)


def greedy_sequences(llm, max_tokens: int = 64) -> tuple[list[list[int]], list[list[int]]]:
    """``(prompt_ids, prompt + greedy continuation)`` of each of ``PROMPTS``."""
    from aioengine import SamplingParams

    tok = llm.tokenizer
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    return prompt_ids, [p + list(o.outputs[0].token_ids) for p, o in zip(prompt_ids, outs)]


@dataclass
class Agreement:
    agree: int  # generated positions whose next-token argmax is the reference's
    total: int
    ppl_ref: float  # perplexity on TEXT
    ppl_ours: float

    def report(self, name: str, num_text_tokens: int) -> str:
        return (f"{name}: {self.agree}/{self.total} next tokens agree with the reference; "
                f"perplexity {self.ppl_ours:.4f} vs {self.ppl_ref:.4f} on "
                f"{num_text_tokens} tokens")


def agreement(prompt_ids: list[list[int]], seqs: list[list[int]], ref: list[torch.Tensor],
              ours: list[torch.Tensor], text: list[int], ref_text: torch.Tensor,
              ours_text: torch.Tensor) -> Agreement:
    """Compare teacher-forced log-softmaxes (``teacher_forced``'s) of the two paths.

    Raises:
        AssertionError: the reference does not replay its own greedy tokens.
    """
    agree = total = 0
    for s, p, r, o in zip(seqs, prompt_ids, ref, ours):
        gen = slice(len(p) - 1, len(s) - 1)  # the positions that predict generated tokens
        assert torch.equal(r[gen].argmax(-1), torch.tensor(s[len(p):])), "reference replay"
        agree += int((o[gen].argmax(-1) == r[gen].argmax(-1)).sum())
        total += gen.stop - gen.start
    target = torch.tensor(text[1:])
    ppl_ref = math.exp(-ref_text.gather(1, target[:, None]).mean().item())
    ppl_ours = math.exp(-ours_text.gather(1, target[:, None]).mean().item())
    return Agreement(agree, total, ppl_ref, ppl_ours)
