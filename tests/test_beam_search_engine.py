"""LLM.beam_search against HF transformers' beam search, and the KV sharing it rests on.

The must-show of issue 19: ``generate(num_beams=k, num_return_sequences=k,
do_sample=False, length_penalty=..., early_stopping=...)`` and our engine return the
same k sequences in the same order, token for token (near-tie rule of DESIGN.md on
the scores, tests/beam_parity.py), on the default model (GGUF, through the worker
subprocess, so copy_blocks and the engine-chosen tokens cross the shared-memory
ring) and on a random-weight Qwen2 (biases on, in process), for k = 2 and 4, three
prompts, 32 new tokens. The random model's EOS row is scaled so beams end at many
lengths and some run to max_tokens. One LLM per model for the module.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from beam_parity import assert_beam_parity, hf_beam_search
from parity import hf_model

from aioengine import LLM, BeamSearchParams, SamplingParams
from aioengine.core.kv_cache_manager import cdiv

SETTINGS = {2: (1.0, False), 4: (0.5, True)}  # k -> (length_penalty, early_stopping)
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village by the sea,"]


@pytest.fixture(scope="module")
def random_qwen2(tmp_path_factory, tokenizer_dir):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from aioengine.models.loader import load_tokenizer

    path = tmp_path_factory.mktemp("qwen2_beam")
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    eos = load_tokenizer(str(path)).eos_token_id
    config = Qwen2Config(vocab_size=49152, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rope_theta=10000.0,
                         tie_word_embeddings=False, initializer_range=0.1, sliding_window=None,
                         eos_token_id=eos)
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.1)
        hf.lm_head.weight[eos] *= 2.2  # EOS competes: beams end at many lengths
    hf.save_pretrained(path, safe_serialization=True)
    llm = LLM(str(path), executor="inproc", dtype="float32", block_size=16)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 17, 30)]
    yield llm, hf, prompts, eos
    llm.shutdown()


@pytest.fixture(scope="module")
def default_llm():
    llm = LLM(block_size=16)  # the worker subprocess executor, as served
    yield llm
    llm.shutdown()


def check_against_hf(name, llm, hf, prompts, k, eos):
    length_penalty, early_stopping = SETTINGS[k]
    params = BeamSearchParams(beam_width=k, max_tokens=32, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    copies_before = llm.stats().num_cow_copies
    outputs = llm.beam_search(prompts, params)
    ties, lengths = [], []
    for prompt, out in zip(prompts, outputs):
        assert len(out.sequences) == k
        ours = [s.tokens[len(prompt):] for s in out.sequences]
        assert all(s.tokens[:len(prompt)] == prompt for s in out.sequences)
        scores = [s.cum_logprob / len(t) ** length_penalty for s, t in zip(out.sequences, ours)]
        ref, ref_scores = hf_beam_search(hf, prompt, k, 32, length_penalty, early_stopping, eos)
        ties.append(assert_beam_parity(f"{name} k={k} {len(prompt)}-token prompt", ours, scores,
                                       ref, ref_scores))
        for s, t in zip(out.sequences, ours):
            assert s.finish_reason == ("stop" if t[-1] == eos else "length")
            assert s.text == llm.tokenizer.decode(t[:-1] if t[-1] == eos else t,
                                                  skip_special_tokens=True)
        lengths += [len(t) for t in ours]
    assert sum(t is not None for t in ties) <= 1, ties
    stats = llm.stats()
    assert stats.num_cow_copies > copies_before  # the beams shared partial blocks
    assert stats.num_kv_blocks_used == 0 and stats.num_kv_blocks_shared == 0
    return lengths


@pytest.mark.parametrize("k", [2, 4])
def test_random_qwen2_beams_equal_hf(random_qwen2, k):
    llm, hf, prompts, eos = random_qwen2
    lengths = check_against_hf("qwen2", llm, hf, prompts, k, eos)
    assert min(lengths) < 32 and max(lengths) == 32  # EOS and max_tokens both end beams


@pytest.mark.parametrize("k", [2, 4])
def test_default_model_beams_equal_hf(default_llm, k):
    prompts = [default_llm.tokenizer.encode(p) for p in PROMPTS]
    check_against_hf("SmolLM2", default_llm, hf_model(), prompts, k,
                     default_llm.tokenizer.eos_token_id)


def test_four_beams_use_well_under_four_sequences_of_blocks(default_llm):
    """Peak blocks of a 4-beam, 64-token search against one greedy sequence's."""
    engine, executor = default_llm.engine, default_llm.executor
    prompt = default_llm.tokenizer.encode(
        "Summarise the following paragraph in one sentence. " * 12)
    engine.add_beam_search_request("peak", prompt, BeamSearchParams(4, 64, ignore_eos=True))
    peak, steps = 0, 0
    pool = engine.kv_cache_manager.block_pool
    while engine.has_unfinished_requests():
        so = engine.schedule()
        peak = max(peak, pool.num_used_blocks)
        (out,) = engine.process_output(so, executor.execute_model(so)) or [None]
        steps += 1
    one_sequence = cdiv(len(prompt) + 64, engine.kv_cache_manager.block_size)
    print(f"\n4-beam request, {len(prompt)}-token prompt, 64 new tokens: peak {peak} blocks, "
          f"one sequence {one_sequence} blocks ({peak / one_sequence:.2f}x)")
    assert out is not None and [len(c.token_ids) for c in out.outputs] == [64] * 4
    assert peak < 2 * one_sequence
    assert pool.num_used_blocks == 0


def test_sampling_with_n_keeps_working_beside_beams(default_llm):
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=8)
    (first,) = default_llm.generate(["Hello there"], params, use_tqdm=False)
    (again,) = default_llm.generate(["Hello there"], params, use_tqdm=False)
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


def test_beams_wider_than_max_num_seqs_survive_preemption(default_llm):
    """8 beams, 4 seats, a cache far short of 8 sequences: beams are preempted
    while their siblings wait with their candidates. The preempted beam used to
    be locked out (the idle siblings filled every seat and held its blocks) and
    the engine spun idle forever; now the search ends, as with room to spare."""
    prompt = default_llm.tokenizer.encode("The history of the Roman empire " * 5)
    params = BeamSearchParams(8, 70, ignore_eos=True)
    (expected,) = default_llm.beam_search([prompt], params)
    small = LLM(block_size=16, num_gpu_blocks_override=24, max_num_seqs=4, executor="inproc")
    try:
        engine = small.engine
        engine.add_beam_search_request("tight", prompt, params)
        outputs = []
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            outputs += [o for o in engine.step().request_outputs if o.finished]
        assert not engine.has_unfinished_requests(), "the beam search hung"
        assert engine.core.scheduler.stats.num_preemptions > 0
        (out,) = outputs
        assert [list(c.token_ids) for c in out.outputs] == [
            s.tokens[len(prompt):] for s in expected.sequences]
        assert small.stats().num_kv_blocks_used == 0
    finally:
        small.shutdown()
