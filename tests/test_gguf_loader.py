"""The GGUF loader (``aioengine.models.gguf_loader``, ``loader``) against its oracles.

- The header parse equals ``gguf.GGUFReader``'s: every metadata field, every tensor's
  type, shape, offset and bytes (on a written file and on the default model).
- The tensors are the file's bytes (views of the mapping, not copies), in their stored
  formats; dequantized, they equal ``gguf.quants.dequantize`` of the HF-order blocks the
  file was written from, and the weights transformers' GGUF loader produces (names, Q/K
  permutation undone, values), for F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
  Q5_K and Q6_K.
- The config equals transformers' ``AutoConfig`` of the file; the (cached) tokenizer
  equals transformers' GGUF tokenizer.
- Greedy tokens of the engine on the random multi-format file equal HF transformers'
  (fp32, dequantized) under DESIGN.md's near-tie rule.
- Bad input is refused with a ValueError that names the problem, and ``aioengine
  serve`` prints it as one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_models import (
    QT,
    TinyLlama,
    default_layer_types,
    dequantized,
    random_blocks,
    tokenizer_metadata,
    write_llama_gguf,
)
from parity import assert_greedy_parity, hf_greedy

from aioengine import LLM, SamplingParams
from aioengine.config import default_model_path
from aioengine.models import loader
from aioengine.models.gguf_file import SUPPORTED_TENSOR_TYPES, GGUFFile, SkippedArray
from aioengine.models.gguf_loader import (
    check_gguf_model,
    hf_config_dict,
    load_gguf_weights,
    raw_tensor,
    unpermute_rows,
)
from triton_kernels.quant import SUPPORTED_QTYPES, QuantizedWeight

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Explain gravity to a child."]
NEW_TOKENS = 10  # each step dequantizes the 49152-row LM head until the kernels land


@pytest.fixture(scope="module")
def tokenizer_meta() -> dict:
    return tokenizer_metadata()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer_meta):
    """``(path, expected)``: the multi-format random Llama GGUF and its HF-order blocks."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_1.gguf"
    expected = write_llama_gguf(path, tokenizer=tokenizer_meta)
    return path, expected


def _field_value(field):
    return field.contents()


# -- the header ------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_header_equals_gguf_reader(which, tiny):
    path = str(tiny[0]) if which == "tiny" else default_model_path()
    ours = GGUFFile.read(path, string_arrays=True)
    ref = gguf.GGUFReader(path)
    assert ours.data_offset == ref.data_offset
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        assert ours.metadata[key] == _field_value(ref.fields[key]), key
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == t.tensor_type
        assert info.shape == tuple(reversed(t.shape.tolist()))
        assert (info.offset, info.nbytes) == (t.data_offset, t.n_bytes)
        raw = raw_tensor(ours, t.name).numpy().reshape(-1)
        assert np.array_equal(raw, np.asarray(t.data).reshape(-1).view(np.uint8)), t.name


def test_header_reader_knows_the_kernels_formats_without_importing_them():
    assert SUPPORTED_TENSOR_TYPES == (QT.F32, *SUPPORTED_QTYPES)


def test_checking_a_gguf_model_imports_no_torch():
    """The engine process checks the file before it starts the worker; torch would delay
    the start by seconds."""
    code = ("import sys; from aioengine.models.loader import inspect_model; "
            "from aioengine.config import default_model_path; "
            "print(inspect_model(default_model_path()).describe()); "
            "print('torch' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split("\n")
    assert out[:2] == ["gguf weights Q4_1 x210, F32 x61, Q8_0 x1", "False"], out


def test_string_arrays_are_skipped_unless_asked_for():
    f = GGUFFile.read(default_model_path())
    tokens = f.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, SkippedArray) and tokens == 49152
    assert f.metadata["tokenizer.ggml.token_type"][:2] == [3, 3]  # numeric arrays are read
    assert f.type_counts() == {"Q4_1": 210, "F32": 61, "Q8_0": 1}


# -- tensors ---------------------------------------------------------------------------------


def test_tensors_are_views_of_the_mapped_file_in_their_stored_formats(tiny):
    path, _ = tiny
    f = GGUFFile.read(str(path))
    weights = load_gguf_weights(f, check_gguf_model(f))
    mapping = f._mapping[0]
    base = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    inside = 0
    for name, w in weights.items():
        data = w.data if isinstance(w, QuantizedWeight) else w
        in_file = base <= data.data_ptr() < base + f.file_size
        # Only Q and K, whose rows are reordered, live outside the mapping.
        assert in_file == (".q_proj." not in name and ".k_proj." not in name), name
        inside += in_file
    assert inside == len(weights) - 4
    o_proj = weights["model.layers.0.self_attn.o_proj.weight"]
    assert isinstance(o_proj, QuantizedWeight) and o_proj.qtype == QT.Q5_1
    assert isinstance(weights["model.layers.1.self_attn.o_proj.weight"], torch.Tensor)  # F32
    assert weights["model.layers.0.mlp.down_proj.weight"].qtype == QT.BF16
    assert weights["model.norm.weight"].dtype == torch.float32


def test_weights_equal_gguf_dequantize_of_the_hf_order_blocks(tiny):
    path, expected = tiny
    f = GGUFFile.read(str(path))
    weights = load_gguf_weights(f, check_gguf_model(f))
    assert set(weights) == set(expected)
    for name, (data, qtype, shape) in expected.items():
        w = weights[name]
        if isinstance(w, QuantizedWeight):
            assert w.qtype == qtype and w.shape == shape, name
            # Byte-identical blocks, so the Q/K rows were put back exactly.
            assert np.array_equal(w.data.numpy(), data), name
            got = w.dequantize()
        else:
            got = w
        assert torch.equal(got, dequantized(data, qtype, shape)), name


def test_unpermute_inverts_convert_hf_to_gguf_permute():
    from gguf_models import convert_permute

    for rows, heads in [(576, 9), (192, 3), (64, 1), (256, 4)]:
        hf = np.arange(rows)
        stored = convert_permute(hf, heads, None)
        assert np.array_equal(stored[unpermute_rows(rows, heads).numpy()], hf)


@pytest.fixture(scope="module")
def hf_tiny(tiny):
    """HF transformers' LlamaForCausalLM from the tiny file (its GGUF loader), fp32."""
    from transformers import AutoModelForCausalLM

    path, _ = tiny
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


def test_weights_equal_what_transformers_loads(tiny, hf_tiny):
    path, _ = tiny
    f = GGUFFile.read(str(path))
    weights = load_gguf_weights(f, check_gguf_model(f))
    ref = hf_tiny.state_dict()
    assert set(weights) == set(ref), set(weights) ^ set(ref)
    for name, w in weights.items():
        ours = w.dequantize() if isinstance(w, QuantizedWeight) else w
        assert torch.equal(ours, ref[name].float()), name


def test_config_equals_transformers_config(tiny):
    from transformers import AutoConfig

    for path in (tiny[0], Path(default_model_path())):
        ref = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        ours = hf_config_dict(GGUFFile.read(str(path)))
        for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "rms_norm_eps", "max_position_embeddings",
                    "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
            assert ours[key] == getattr(ref, key), (path.name, key)
        theta = getattr(ref, "rope_theta", None) or ref.rope_parameters["rope_theta"]
        assert ours["rope_theta"] == theta


def test_cached_tokenizer_equals_transformers_gguf_tokenizer(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path))
    path = Path(default_model_path())
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    built = loader.load_tokenizer(str(path))          # builds and writes the cache
    entries = list((tmp_path / "tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    cached = loader.load_tokenizer(str(path))         # reads the cache
    texts = ["Hello, world!", "  leading spaces\tand tabs\n\nnewlines", "naïve café 東京 🙂",
             "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x**2  # ok", ""]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    for tok in (built, cached):
        for text in texts:
            assert tok.encode(text) == ref.encode(text), text
            ids = ref.encode(text)
            assert tok.decode(ids) == ref.decode(ids)
        assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
            ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == \
            (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id, len(ref))
        assert tok.convert_ids_to_tokens(list(range(0, 49152, 997))) == \
            ref.convert_ids_to_tokens(list(range(0, 49152, 997)))


# -- the engine on the file against HF -------------------------------------------------------


def test_greedy_tokens_match_hf_on_a_multi_format_gguf(tiny, hf_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path))
    path, _ = tiny
    llm = LLM(str(path), executor="inproc", num_gpu_blocks_override=64)
    try:
        assert llm.model_info.quantization == "gguf"
        assert llm.model_info.weight_formats["Q6_K"] == 3
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                logprobs=2)
        prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        outs = llm.generate(prompt_ids, params, use_tqdm=False)
        model = llm.executor.runner.model
        assert model.weight_formats()["Q4_K+Q5_K+Q6_K"] == 1  # layer 1's Q/K/V stay per part
    finally:
        llm.shutdown()
    ties = []
    for name, ids, out in zip(PROMPTS, prompt_ids, outs):
        c = out.outputs[0]
        ours_top2 = [sorted(lp.values(), reverse=True)[:2] for lp in c.logprobs]
        ref_tokens, ref_top2 = hf_greedy(hf_tiny, ids, NEW_TOKENS)
        ties.append(assert_greedy_parity(name, c.token_ids, ref_tokens, ours_top2, ref_top2))
    assert sum(t is None for t in ties) >= len(ties) - 1, ties


# -- bad input -------------------------------------------------------------------------------


def _tiny_with(tmp_path: Path, tokenizer_meta: dict, **kwargs) -> Path:
    path = tmp_path / "bad.gguf"
    shape = TinyLlama(layers=1)
    write_llama_gguf(path, shape, layer_types=[default_layer_types()[0]],
                     tokenizer=tokenizer_meta, **kwargs)
    return path


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="model path does not exist"):
        LLM(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError):
        GGUFFile.read(str(tmp_path / "nope.gguf"))


def test_non_gguf_bytes_and_truncation_are_clear_errors(tmp_path, tiny):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"<html>not a model</html>" * 4)
    with pytest.raises(ValueError, match=r"junk.gguf is not a GGUF file \(it starts with"):
        loader.inspect_model(str(junk))
    short = tmp_path / "short.gguf"
    short.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="not a GGUF file"):
        loader.inspect_model(str(short))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny[0].read_bytes()[:200_000])  # inside the tokenizer metadata
    with pytest.raises(ValueError, match="corrupt or truncated GGUF header"):
        loader.inspect_model(str(cut))
    cut.write_bytes(tiny[0].read_bytes()[:-1000])    # header whole, last tensor cut short
    with pytest.raises(ValueError, match=r"lies outside the .*file .* truncated or corrupt"):
        loader.inspect_model(str(cut))


@pytest.mark.parametrize("qtype", [QT.IQ2_XS, QT.Q2_K, QT.Q3_K, QT.IQ4_NL])
def test_unsupported_ggml_types_are_refused_naming_tensor_and_type(tmp_path, tokenizer_meta,
                                                                   qtype):
    rng = np.random.default_rng(0)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (4, 256 // block_size * type_size), dtype=np.uint8)
    path = _tiny_with(tmp_path, tokenizer_meta, extra_tensors={"blk.0.extra.weight":
                                                               (blocks, qtype)})
    with pytest.raises(ValueError, match=rf"'blk.0.extra.weight' is stored as {qtype.name}, "
                                         rf"which aioengine cannot run; supported: F32, "):
        loader.inspect_model(str(path))


def test_unsupported_architecture_and_unknown_tensors_are_refused(tmp_path, tokenizer_meta):
    path = _tiny_with(tmp_path, tokenizer_meta, architecture="gpt2")
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported; "
                                         "supported: llama, qwen2"):
        loader.inspect_model(str(path))
    rows = random_blocks(4, 256, QT.Q8_0, np.random.default_rng(0))
    path = _tiny_with(tmp_path, tokenizer_meta, extra_tensors={"blk.0.ssm_conv.weight":
                                                               (rows, QT.Q8_0)})
    with pytest.raises(ValueError, match=r"'blk\.0\.ssm_conv\.weight' has no counterpart"):
        loader.inspect_model(str(path))


def test_quantization_flag_with_a_gguf_file_is_refused():
    with pytest.raises(ValueError, match="is a GGUF file, already quantized"):
        LLM(quantization="int4")


def test_serve_prints_one_line_for_an_unsupported_tensor_type(tmp_path, tokenizer_meta):
    """preflight (tests/test_bad_start.py) answers for files that are not GGUF; a GGUF file
    whose tensors the kernels cannot run is refused by the loader's header check, in one
    line too."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (4, 74), dtype=np.uint8)  # one IQ2_XS block per row
    path = _tiny_with(tmp_path, tokenizer_meta, extra_tensors={"blk.0.extra.weight":
                                                               (blocks, QT.IQ2_XS)})
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-m", "aioengine.entrypoints.cli", "serve",
                           "--model", str(path), "--port", "0"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"aioengine: error: {path}: tensor 'blk.0.extra.weight' is stored as "
                     f"IQ2_XS, which aioengine cannot run; supported: F32, Q8_0, Q4_0, Q4_1, "
                     f"Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16"], proc.stderr


def test_llama3_rope_freqs_tensor_divides_the_rotary_frequencies(tmp_path, tokenizer_meta):
    """convert_hf_to_gguf writes llama3 RoPE scaling as a ``rope_freqs`` tensor of
    per-frequency divisors (llama.cpp's ggml_rope_ext: theta / freq_factor)."""
    from types import SimpleNamespace

    from aioengine.models.llama import LlamaArch, LlamaForCausalLM

    shape = TinyLlama(layers=1)
    factors = np.linspace(1.0, 8.0, shape.head_dim // 2, dtype=np.float32)
    path = _tiny_with(tmp_path, tokenizer_meta,
                      extra_tensors={"rope_freqs.weight": (factors, QT.F32)})
    f = GGUFFile.read(str(path))
    config = check_gguf_model(f)
    arch = LlamaArch.from_hf_config(SimpleNamespace(**config))
    model = LlamaForCausalLM(arch, load_gguf_weights(f, config), torch.float32, 64)
    inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, shape.head_dim, 2).float()
                                          / shape.head_dim) / torch.from_numpy(factors)
    angles = torch.outer(torch.arange(64).float(), inv_freq)
    torch.testing.assert_close(model.rotary.cos[:, :shape.head_dim // 2], angles.cos())
