"""Every model family of the registry against HF transformers on tiny random weights
(hidden 64, 2 layers; ``family_models``): Llama 3.x (llama3 RoPE, untied head), Mistral
(sliding window 8), Qwen2 (Q/K/V biases), Qwen3 (Q/K norms, head_dim 32 != hidden/heads),
Gemma 2 (soft-capping, local/global layers, query_pre_attn_scalar), Gemma 3 (Q/K
norms, per-layer-type RoPE with linear scaling on the global layer), Phi-3 (fused
projections, LongRoPE, partial rotary) and plain Phi-3.

Each runs 4 prompts x 24 greedy tokens in one continuous batch through ``LLM`` with
prefix caching (two prompts share 2 blocks of 8 tokens), chunked prefill (a step
budget of 24 tokens splits the 37-token prompt) and mixed lengths (3 to 37 tokens:
all but the shortest longer than the sliding window). Tokens must equal HF
``generate``'s (the near-tie rule of DESIGN.md); the logprob of each of the first 8
tokens must be within 1e-4 of HF's (both fp32). The GGUF file of the same weights
(written as llama.cpp's converter writes it) must give the tokens of the safetensors
folder. Every family but partial-rotary Phi-3 decodes through the fused C++ step
(``cpu_ops.LlamaDecodeLayers``); a spy on it checks every all-decode step took it, so
for Qwen3 and Gemma 2/3 the tokens above are the fused path's, past the window.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from functools import lru_cache
from unittest.mock import patch

import pytest
import torch
from family_models import (FAMILIES, GEMMA_TEMPLATE, build_hf_model, save_hf_folder,
                           tiny_tokenizer, write_gguf)
from parity import assert_greedy_parity

from aioengine import LLM, SamplingParams
from aioengine.models import registry
from aioengine.models.loader import load_tokenizer
from triton_kernels import cpu_ops

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 24
LOGPROB_TOKENS, LOGPROB_TOL = 8, 1e-4
SHARED = ("In the beginning the engineers wrote a small engine that served many models "
          "to many people")
TEXTS = ["Hello there", SHARED + " at once.", SHARED + " on a small machine.",
         "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm "
         "mat by the window and dreams"]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
# One torch thread, here and in the engine: on models this small a second thread costs
# more than it gives, and 3-4x more on a machine shared with other jobs.
ENGINE = dict(executor="inproc", block_size=8, max_num_batched_tokens=24,
              enable_prefix_caching=True, max_model_len=256, num_threads=1)
# llama.cpp writes Mistral as ``llama`` and keeps no sliding window (it attends to the
# whole context, and so do we for such a file).
NO_GGUF = {"mistral": "a Mistral GGUF carries no sliding window"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@lru_cache(maxsize=1)
def _tiny():
    return tiny_tokenizer()


def tokenizer():
    return _tiny()[0]


def gguf_tokenizer():
    return _tiny()[1]


_built: dict[str, tuple] = {}


def built(name: str, workdir):
    """``(hf_model, folder, gguf path or None)`` of a family, built once per module."""
    if name not in _built:
        family = FAMILIES[name]
        model = build_hf_model(family, tokenizer())
        folder = save_hf_folder(model, tokenizer(), family, workdir / name)
        path = None
        if name not in NO_GGUF:
            path = write_gguf(model, family, workdir / f"{name}.gguf", gguf_tokenizer())
        _built[name] = (model, folder, path)
    return _built[name]


def prompt_ids() -> list[list[int]]:
    return [tokenizer().encode(t, add_special_tokens=False) for t in TEXTS]


def hf_reference(model, ids: list[int]):
    """HF greedy tokens, per-step top-2 logprobs and the chosen tokens' logprobs."""
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                         do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    steps = [s[0].float().log_softmax(-1) for s in out.logits]
    return tokens, [s.topk(2).values.tolist() for s in steps], \
        [s[t].item() for s, t in zip(steps, tokens)]


_runs: dict[tuple[str, str], list] = {}


@contextmanager
def fused_step_spy():
    """Yields a list that gets, for each step offered to the fused C++ decode layers
    (``cpu_ops.LlamaDecodeLayers.forward``, in this process), ``(all_decodes, taken)``."""
    steps: list[tuple[bool, bool]] = []
    real = cpu_ops.LlamaDecodeLayers.forward

    def forward(self, residual, cos, sin, kv_cache, plan, scale):
        out = real(self, residual, cos, sin, kv_cache, plan, scale)
        steps.append((plan is not None and plan.prefill is None, out is not None))
        return out

    with patch.object(cpu_ops.LlamaDecodeLayers, "forward", forward):
        yield steps


def run(name: str, kind: str, workdir, **overrides):
    """``(completions, fused, max_model_len, steps)``: ``fused`` whether the model built
    the C++ decode step, ``steps`` what ``fused_step_spy`` saw (inproc executor)."""
    key = (name, kind)
    if key not in _runs or overrides:
        _, folder, path = built(name, workdir)
        with fused_step_spy() as steps:
            llm = LLM(str(folder if kind == "hf" else path), **(ENGINE | overrides))
            try:
                outs = llm.generate(prompt_ids(), GREEDY, use_tqdm=False)
                runner = getattr(llm.executor, "runner", None)
                fused = runner is not None and runner.model.decode_layers is not None
                result = ([o.outputs[0] for o in outs], fused, llm.executor.max_model_len,
                          list(steps))
            finally:
                llm.shutdown()
        if overrides:
            return result
        _runs[key] = result
    return _runs[key]


def assert_matches_hf(name: str, completions, model) -> None:
    ties = []
    for text, ids, c in zip(TEXTS, prompt_ids(), completions):
        ref, ref_top2, ref_lp = hf_reference(model, ids)
        ours_top2 = [sorted(lp.values(), reverse=True)[:2] for lp in c.logprobs]
        tie = assert_greedy_parity(f"{name} {text[:20]!r}", c.token_ids, ref, ours_top2,
                                   ref_top2)
        ties.append(tie)
        agree = next((i for i, (a, b) in enumerate(zip(c.token_ids, ref)) if a != b), len(ref))
        for i in range(min(LOGPROB_TOKENS, agree)):
            ours = c.logprobs[i][c.token_ids[i]]
            assert abs(ours - ref_lp[i]) < LOGPROB_TOL, (name, text, i, ours, ref_lp[i])
    assert sum(t is None for t in ties) >= len(ties) - 1, ties


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_and_logprobs_match_hf(name, workdir):
    model, _, _ = built(name, workdir)
    completions, fused, _, steps = run(name, "hf", workdir)
    assert_matches_hf(name, completions, model)
    if cpu_ops.load() is not None:  # the C++ decode step where it computes the family's block
        assert fused == FAMILIES[name].fused_decode, (name, fused)
        if fused:  # every all-decode step took it: the tokens above came through it
            decodes = [taken for all_decodes, taken in steps if all_decodes]
            assert len(decodes) >= NEW_TOKENS - 2 and all(decodes), (name, steps)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in NO_GGUF])
def test_gguf_gives_the_tokens_of_the_safetensors_folder(name, workdir):
    hf_completions, *_ = run(name, "hf", workdir)
    gguf_completions, *_ = run(name, "gguf", workdir)
    ties = []
    for text, a, b in zip(TEXTS, gguf_completions, hf_completions):
        ties.append(assert_greedy_parity(
            f"{name} gguf {text[:20]!r}", a.token_ids, b.token_ids,
            [sorted(lp.values(), reverse=True)[:2] for lp in a.logprobs],
            [sorted(lp.values(), reverse=True)[:2] for lp in b.logprobs]))
    assert sum(t is None for t in ties) >= len(ties) - 1, ties


def test_max_model_len_is_the_models_own(workdir):
    _, folder, _ = built("qwen3", workdir)
    llm = LLM(str(folder), executor="inproc", block_size=8, num_threads=1)
    try:
        assert llm.executor.max_model_len == 512  # config.json's max_position_embeddings
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_tensor_parallel_2_matches_hf(name, workdir):
    model, _, _ = built(name, workdir)
    completions, *_ = run(name, "hf", workdir, executor="process", tensor_parallel_size=2)
    assert_matches_hf(f"{name} tp2", completions, model)


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_chat_template_comes_from_the_models_files(kind, workdir):
    _, folder, path = built("gemma2", workdir)
    tok = load_tokenizer(str(folder if kind == "hf" else path))
    assert tok.chat_template == GEMMA_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", text
    with pytest.raises(Exception, match="System role not supported"):
        tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": "hi"}], tokenize=False)


def test_an_unknown_architecture_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "mamba"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 64,
         "num_hidden_layers": 2, "vocab_size": 100}))
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(registry.UnsupportedModelError) as info:
        LLM(str(folder), executor="inproc")
    message = str(info.value)
    assert "\n" not in message and "'MambaForCausalLM'" in message
    for family in registry.FAMILIES:
        assert f"({'/'.join(family.model_types)})" in message


def test_the_registry_maps_hf_and_gguf_names_to_classes():
    from aioengine.models.gemma import GemmaForCausalLM
    from aioengine.models.llama import LlamaForCausalLM
    from aioengine.models.phi3 import Phi3ForCausalLM
    from aioengine.models.qwen3 import Qwen3ForCausalLM

    def cls(**config):
        from types import SimpleNamespace

        return registry.model_class(registry.family_of_config(SimpleNamespace(**config)))

    assert cls(architectures=["MistralForCausalLM"], model_type="mistral") is LlamaForCausalLM
    assert cls(model_type="qwen3") is Qwen3ForCausalLM
    assert cls(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text") is \
        GemmaForCausalLM
    assert cls(model_type="phi3") is Phi3ForCausalLM
    assert registry.family_of_gguf("gemma2").name == "gemma2"
    with pytest.raises(registry.UnsupportedModelError, match="the multimodal Gemma 3"):
        cls(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3")
    with pytest.raises(registry.UnsupportedModelError, match="supported: llama, qwen2"):
        registry.family_of_gguf("mamba")


# -- served: the chat template's refusal, /v1/models, an unknown architecture at start ------


@pytest.fixture(scope="module")
def gemma_server(workdir):
    from conftest import start_server, stop_server

    _, folder, _ = built("gemma2", workdir)
    info = start_server(workdir, "--model", str(folder))
    yield info
    stop_server(info)


def test_a_template_that_refuses_the_system_role_is_a_400(gemma_server):
    import httpx

    with httpx.Client(base_url=gemma_server.base_url, headers=gemma_server.headers,
                      timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]
        assert model["max_model_len"] == 512  # config.json's max_position_embeddings
        refused = http.post("/v1/chat/completions", json={
            "model": model["id"], "max_tokens": 2,
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hi"}]})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert "System role not supported" in error["message"]
        assert error["type"] == "invalid_request_error"
        ok = http.post("/v1/chat/completions", json={
            "model": model["id"], "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert ok.status_code == 200, ok.text  # the server carries on


def test_serve_refuses_an_unknown_architecture_in_one_line(tmp_path):
    from test_bad_start import assert_one_line_error, run_serve

    folder = tmp_path / "mamba"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 64,
         "num_hidden_layers": 2, "vocab_size": 100}))
    (folder / "model.safetensors").write_bytes(b"")
    proc, elapsed = run_serve("--model", str(folder), "--port", "0")
    assert_one_line_error(proc, elapsed, "'mamba'")
    for name in ("qwen3", "gemma3_text", "phi3", "gemma2"):
        assert name in proc.stderr
