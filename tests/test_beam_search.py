"""The beam-search rules (aioengine/engine/beam_search.py) against HF transformers.

Here the beams run on HF's own model (a full forward per beam per step), so only the
search is under test: which candidates survive, when a beam finishes, its
length-penalised score, early stopping, the returned order. A tiny random-weight
Qwen2 with a 96-token vocabulary makes EOS (id 3) a frequent candidate, so beams
finish at many lengths. The engine's beam search is tested against HF in
test_beam_search_engine.py.
"""

from __future__ import annotations

import pytest
import torch
from beam_parity import assert_beam_parity, hf_beam_search

from aioengine.engine.beam_search import BeamSearchParams, BeamSearchState
from aioengine.sampling_params import SamplingParamError

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 3
VOCAB = 96


@pytest.fixture(scope="module")
def tiny_qwen2():
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         initializer_range=0.1, sliding_window=None, eos_token_id=EOS,
                         bos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.1)
    return model


def run_on_hf_model(model, prompt: list[int], params: BeamSearchParams):
    state = BeamSearchState(params, {EOS})
    seqs = [list(prompt)]
    steps = 0
    while not state.done:
        with torch.no_grad():
            lp = torch.stack([model(torch.tensor([s])).logits[0, -1].log_softmax(-1)
                              for s in seqs])
        top = lp.topk(state.num_candidates, dim=-1)
        seqs = [seqs[i] + [t] for i, t in state.step(
            [list(zip(i.tolist(), v.tolist())) for v, i in zip(top.values, top.indices)])]
        steps += 1
    assert steps <= params.max_tokens
    return state


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("length_penalty,early_stopping",
                         [(1.0, False), (0.5, True), (2.0, "never"), (-1.0, False)])
def test_search_equals_hf_generate(tiny_qwen2, k, length_penalty, early_stopping):
    g = torch.Generator().manual_seed(1)
    ties = []
    for n in (3, 9, 20):
        prompt = torch.randint(EOS + 1, VOCAB, (n,), generator=g).tolist()
        state = run_on_hf_model(tiny_qwen2, prompt, BeamSearchParams(
            k, 32, length_penalty=length_penalty, early_stopping=early_stopping))
        ref, ref_scores = hf_beam_search(tiny_qwen2, prompt, k, 32, length_penalty,
                                         early_stopping, EOS)
        ours = [b.tokens for b in state.finished]
        ties.append(assert_beam_parity(f"k={k} lp={length_penalty} es={early_stopping} n={n}",
                                       ours, [b.score for b in state.finished], ref, ref_scores))
        for b in state.finished:
            assert b.finish_reason == ("stop" if b.tokens[-1] == EOS else "length")
            assert b.score == pytest.approx(b.cum_logprob / len(b.tokens) ** length_penalty)
    assert all(t is None for t in ties), ties


def test_some_beams_finish_early_on_eos(tiny_qwen2):
    """The fixture's model ends beams before max_tokens, so the EOS rules are exercised."""
    g = torch.Generator().manual_seed(1)
    finished_early = 0
    for n in (3, 9, 20):
        prompt = torch.randint(EOS + 1, VOCAB, (n,), generator=g).tolist()
        state = run_on_hf_model(tiny_qwen2, prompt, BeamSearchParams(4, 32, length_penalty=0.5,
                                                                     early_stopping=True))
        finished_early += sum(b.finish_reason == "stop" for b in state.finished)
    assert finished_early >= 3


def test_ignore_eos_runs_every_beam_to_max_tokens(tiny_qwen2):
    state = run_on_hf_model(tiny_qwen2, [10, 20, 30], BeamSearchParams(3, 12, ignore_eos=True))
    assert [len(b.tokens) for b in state.finished] == [12, 12, 12]
    assert all(b.finish_reason == "length" for b in state.finished)
    scores = [b.score for b in state.finished]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("field,kwargs", [
    ("beam_width", {"beam_width": 0}), ("beam_width", {"beam_width": 129}),
    ("beam_width", {"beam_width": 10**12}), ("max_tokens", {"max_tokens": 0}),
    ("temperature", {"temperature": 0.7}), ("early_stopping", {"early_stopping": "sometimes"}),
    ("length_penalty", {"length_penalty": float("nan")})])
def test_bad_params_name_the_field(field, kwargs):
    args = {"beam_width": 2, "max_tokens": 4, **kwargs}
    with pytest.raises(SamplingParamError) as exc:
        BeamSearchParams(**args)
    assert exc.value.param == field


def test_step_refuses_misuse():
    state = BeamSearchState(BeamSearchParams(2, 1), {EOS})
    with pytest.raises(ValueError):
        state.step([])
    assert state.step([[(5, -0.1), (6, -0.2), (7, -0.3), (8, -0.4)]]) == []
    assert state.done and [b.tokens for b in state.finished] == [[5], [6]]
    with pytest.raises(ValueError):
        state.step([[(5, -0.1)]])
