"""The C++ CPU kernels of ``csrc/`` (one file per kernel, ``bindings.cpp``), built on first use.

``torch.utils.cpp_extension.load`` compiles them with ``-O3 -march=native`` (about a
minute on two cores, once per machine, environment and source version). The build is
cached under torch's extensions directory, keyed by the sources, the CPU's
instruction-set flags, the Python environment (``sys.prefix``) and torch's version: a
shared home directory never serves one CPU another's build, and two virtual
environments on one machine stop rebuilding each other's. The fast path covers fp32
activations with fp32 or GGML-quantized weights (``quant.py``); bf16/fp16 keep the
torch path. Set ``AIOENGINE_CPU_KERNELS=0`` to use the torch implementations throughout.
``AIOENGINE_CPU_KERNELS_BUILD=0`` imports an existing build only, never compiling (every
model worker after the first runs so). ``AIOENGINE_Q8_ACTIVATIONS=1`` turns on the int8
activations of the quantized GEMV (``q8_activations_requested``; AVX-512 VNNI builds).
On a CPU with AMX-BF16 the quantized GEMM (9+ rows) runs on AMX tiles in bf16 by default;
``AIOENGINE_BF16_GEMM=0`` makes it fp32-grade (bf16 hi + lo, 17+ rows) and
``AIOENGINE_AMX=0`` keeps it on the fp32 AVX-512 path (``amx_requested``,
``bf16_gemm_requested``).

``load()`` returns the module, or None when the kernels are switched off or the
build fails (no compiler, say); the reason is logged once and callers fall back
to the torch path of ``reference.py``.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path

import torch

from . import attention_plan, reference

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
#: Set once ``LlamaDecodeLayers`` takes quantized projections (the model gates on it).
QUANTIZED_DECODE_LAYERS = True
#: Every file of the build (sources and headers), in a fixed order: a new kernel is a new
#: ``csrc/*.cpp`` (with its header), bound in ``bindings.cpp``.
_FILES = sorted(p for p in _CSRC.iterdir() if p.suffix in (".cpp", ".h"))
_lock = threading.Lock()
_module = None
_tried = False


def enabled() -> bool:
    """False when ``AIOENGINE_CPU_KERNELS`` is set to 0, false, no or off."""
    return os.environ.get("AIOENGINE_CPU_KERNELS", "1").strip().lower() not in (
        "0", "false", "no", "off")


def _build_key() -> str:
    """Hash of every csrc file, the CPU, the Python environment and torch's version.

    ``-march=native`` makes a build CPU-specific, so the CPU's flags are in the key; the
    environment (``sys.prefix``) and torch's version are because the extension links
    against that torch (issue 23: two venvs on one machine rebuilt each other's kernels).
    """
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:  # x86: "flags"; arm64: "Features"
            cpu += "".join(sorted({line for line in f if line.startswith(("flags", "Features"))}))
    except OSError:
        pass
    digest = hashlib.sha256()
    for path in _FILES:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"{cpu}\0{sys.prefix}\0{torch.__version__}".encode())
    return digest.hexdigest()[:12]


def _build_root() -> Path:
    """torch's extensions directory (``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "torch_extensions"


def _build():
    from torch.utils.cpp_extension import load as load_extension

    name = f"aioengine_cpu_ops_{_build_key()}"
    build_dir = _build_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    # Build from copies inside the build directory, so every checkout of the same sources
    # passes the same paths and finds the build up to date.
    sources = []
    for path in _FILES:
        copy = build_dir / path.name
        if not copy.exists() or copy.read_bytes() != path.read_bytes():
            tmp = build_dir / f".{path.name}.{os.getpid()}"
            tmp.write_bytes(path.read_bytes())
            os.replace(tmp, copy)
        if path.suffix == ".cpp":
            sources.append(str(copy))
    # torch guards a build with a ``lock`` file that a killed builder leaves behind, and
    # its waiters then wait forever. An flock, which the kernel drops when its holder
    # dies, serialises our builders instead; whoever holds it may clear such a lock.
    with open(build_dir / "aioengine.flock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        return load_extension(name=name, sources=sources, build_directory=str(build_dir),
                              extra_cflags=["-O3", "-march=native", "-fopenmp"],
                              extra_ldflags=["-lmvec"], verbose=False)


def q8_activations_requested() -> bool:
    """``AIOENGINE_Q8_ACTIVATIONS`` (default off): whether the quantized GEMV (1-2 rows of
    Q4_0/Q4_1, 1-8 of Q8_0) quantizes its activations to int8 per 32-value block and
    multiplies with VNNI integer dot products, as llama.cpp's q8 activations do. Measured
    1.15-1.4x the fp32-activation GEMV on one core (bench/README.md), perplexity within
    1% of fp32 activations, but next-token agreement 97.5% (998 of 16 x 64), under the
    99% issue 15 asks of a default, so it is opt-in (tests/test_q8_activations.py).
    Builds without AVX-512 VNNI always use fp32."""
    return os.environ.get("AIOENGINE_Q8_ACTIVATIONS", "0").strip().lower() in (
        "1", "true", "yes", "on")


def set_q8_activations(on: bool) -> bool:
    """Switch the int8 activations at run time (tests and benches compare both); returns
    whether the build has them (False: fp32 activations whatever ``on`` says)."""
    ops = load()
    return bool(ops is not None and ops.set_q8_activations(on))


def _env_flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() in ("1", "true", "yes", "on")


def amx_requested() -> bool:
    """``AIOENGINE_AMX`` (default on): whether the quantized GEMM (9+ rows of x) may run on
    AMX-BF16 tiles where the CPU has them (``csrc/quant_amx.h``); off, it runs the fp32
    AVX-512 path."""
    return _env_flag("AIOENGINE_AMX", "1")


def bf16_gemm_requested() -> bool:
    """``AIOENGINE_BF16_GEMM`` (default on): the AMX GEMM with bf16 x and weights, one tile
    product, 2-3.7x MKL fp32 at 32-64 rows on one core (bench/README.md); relative error
    about 2^-8 per product. Against the fp32 path on the default Q4_1 model (16 sequences
    side by side): 1020 of 1024 teacher-forced next tokens agree (99.6%) and perplexity is
    0.1% lower, both within the 1% issue 15 asks of a default (tests/test_quant_amx.py).
    Off (0): x and weights split into bf16 hi + lo and three products summed, within the
    fp32 summation-order bound (tests/test_quant_cpu.py), from 17 rows, 1.3-2x faster
    than the AVX-512 path there. The test suite runs the exact fp32 path
    (``AIOENGINE_AMX=0``, tests/conftest.py) but for the AMX tests."""
    return _env_flag("AIOENGINE_BF16_GEMM", "1")


def set_amx(on: bool) -> bool:
    """Allow or forbid the AMX GEMM and the AMX prefill attention tiles from the next call on
    (the fused decode step's too); returns whether AMX is now in use. Off, every GEMM runs
    the exact fp32 AVX-512 path and prefill attention its fp32 AVX-512 tiles."""
    ops = load()
    return bool(ops is not None and ops.set_amx(on))


def set_bf16_gemm(on: bool) -> bool:
    """The AMX GEMM in bf16 (True, the default) or fp32-grade bf16 hi + lo (False); returns
    whether an AMX GEMM exists here to switch (False: the setting is moot)."""
    ops = load()
    if ops is None:
        return False
    ops.set_bf16_gemm(on)
    return ops.quant_isa() == 3


def bf16_attention_requested() -> bool:
    """``AIOENGINE_BF16_ATTENTION`` (default off): whether the AMX prefill attention tiles
    (``csrc/attention.h`` ``prefill_amx``) take plain bf16 Q, K, P and V (one tile product;
    1.3-1.5x the fp32-grade mode, bench/README.md) instead of fp32-grade bf16 hi + lo. Off
    by default: plain bf16 moved a logprob of the fp32 HF model by 0.01 against the 1e-4
    tests/test_hf_parity.py holds it to."""
    return _env_flag("AIOENGINE_BF16_ATTENTION", "0")


def set_bf16_attention(on: bool) -> bool:
    """The AMX prefill attention tiles in plain bf16 (True) or fp32-grade hi + lo (False)
    from the next call on; returns whether the extension is loaded to switch."""
    ops = load()
    if ops is None:
        return False
    ops.set_bf16_attention(on)
    return True


def build_allowed() -> bool:
    """False when ``AIOENGINE_CPU_KERNELS_BUILD`` is 0: ``load()`` then only imports an
    existing build and never compiles (or waits on another process's compile). A
    restarted model worker runs so: a build belongs before the server reports ready."""
    return os.environ.get("AIOENGINE_CPU_KERNELS_BUILD", "1").strip().lower() not in (
        "0", "false", "no", "off")


def _load_built():
    """Import the build of the current sources, never compiling.

    Raises:
        FileNotFoundError: no finished build for this key.
    """
    import importlib.machinery
    import importlib.util

    name = f"aioengine_cpu_ops_{_build_key()}"
    path = _build_root() / name / f"{name}.so"
    if not path.is_file():
        raise FileNotFoundError(f"no build at {path} and building is off here")
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load():
    """The compiled extension module, or None (switched off, or the build failed, or
    no build exists and ``build_allowed()`` is false)."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        if not enabled():
            # Named like a failed build's, so the log says the torch path is in use and why
            # (docs/troubleshooting.md §5).
            logger.warning("aioengine CPU kernels unavailable, using the torch path: "
                           "AIOENGINE_CPU_KERNELS=%s", os.environ.get("AIOENGINE_CPU_KERNELS"))
        else:
            try:
                if build_allowed():
                    logger.info("loading the C++ CPU kernels (the first build on a machine "
                                "takes one to two minutes on two cores)")
                    _module = _build()
                else:
                    _module = _load_built()
                logger.info("C++ CPU kernels in use: %s", _module.__file__)
                if _module.set_q8_activations(q8_activations_requested()):
                    if q8_activations_requested():
                        logger.info("quantized GEMV: int8 activations (AVX-512 VNNI, "
                                    "AIOENGINE_Q8_ACTIVATIONS=1)")
                _module.set_bf16_gemm(bf16_gemm_requested())
                _module.set_bf16_attention(bf16_attention_requested())
                if _module.set_amx(amx_requested()):
                    logger.info("quantized GEMM: AMX-BF16 tiles, %s",
                                "bf16" if bf16_gemm_requested()
                                else "bf16 hi + lo, fp32-grade (AIOENGINE_BF16_GEMM=0)")
            except Exception as exc:  # no compiler, no ninja, a build error: fall back
                logger.warning("aioengine CPU kernels unavailable, using the torch path: %s",
                               str(exc).strip().splitlines()[-1] if str(exc).strip() else exc)
                _module = None
        _tried = True
        return _module


# -- the CPU fast path -----------------------------------------------------------------------
# Used by the package's dispatchers for CPU tensors; each falls back to the torch
# implementation when the extension is unavailable or the layout does not fit.


def _ops_for(dtype: torch.dtype):
    """The extension for fp32 tensors. Its bf16/fp16 instantiations convert element by
    element and measured slower than torch's vectorised ops, so half dtypes keep the
    torch path."""
    return load() if dtype == torch.float32 else None


def _unit_stride(*tensors: torch.Tensor) -> bool:
    return all(t.stride(-1) == 1 for t in tensors)


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     plan: attention_plan._DecodePlan, scale: float) -> torch.Tensor:
    """Decode rows over the paged cache, read in place (no gather), in C++; the SDPA path of
    ``attention_plan`` when the kernels are unavailable."""
    ops = _ops_for(query.dtype)
    if ops is None or not _unit_stride(query, key_cache, value_cache):
        return attention_plan._decode(query, key_cache, value_cache, plan, scale)
    out = torch.empty_like(query)
    ops.paged_attention_decode(out, query, key_cache, value_cache, plan.block_table,
                               plan.seq_lens, scale)
    return out


def paged_attention_planned(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, plan: attention_plan.AttentionPlan,
                            scale: float) -> torch.Tensor:
    """``attention_plan.paged_attention_planned`` with the decode rows through the C++ kernel
    (prefill rows are compute-bound and stay on SDPA)."""
    return attention_plan.paged_attention_planned(query, key_cache, value_cache, plan, scale,
                                                  decode=decode_attention)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """This step's K/V into their cache slots in C++ (``csrc/cache_write.cpp``), as the fused
    decoder layers write them: rounded to nearest even to the cache's dtype and, for the
    fp8 caches (OFP8 E4M3 / E5M2), saturated at +-448 / +-57344 (``csrc/fp8.h``; its torch
    twin is ``reference.to_kv_cache_dtype``, bit for bit). Returns False, writing nothing,
    where it does not apply: no build, tensors that are not fp32 K/V on the CPU.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` fp32, head_dim stride 1.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int (slot = block_id * block_size + offset; -1
            skips the token).

    Raises:
        RuntimeError: (from C++) a shape, a dtype or a slot out of range.
    """
    ops = load()
    if (ops is None or key.dtype != torch.float32 or value.dtype != torch.float32
            or key_cache.device.type != "cpu" or not _unit_stride(key, value)):
        return False
    ops.reshape_and_cache(key, value, key_cache, value_cache,
                          slot_mapping.to(torch.int64).contiguous())
    return True


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight``."""
    ops = _ops_for(x.dtype)
    if (ops is None or x.dim() != 2 or not (x.is_contiguous() and residual.is_contiguous()
                                            and weight.is_contiguous())):
        reference.fused_add_rms_norm(x, residual, weight, eps)
        return
    ops.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for ``x`` ``[num_tokens, 2 * d]``."""
    ops = _ops_for(x.dtype)
    if ops is None or x.dim() != 2 or not x.is_contiguous():
        return reference.silu_and_mul(x)
    out = x.new_empty(x.shape[0], x.shape[1] // 2)
    ops.silu_and_mul(out, x)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for fp32 CPU tensors: ``x`` ``[M, K]`` @ ``weight[N, K]``^T (+ ``bias[N]``)
    -> ``[M, N]``.

    Up to 16 rows it is the C++ skinny kernel, which reads each weight row once for four
    rows of ``x`` (``bench/cpu_decode.py`` on the default model's linears: on par with
    MKL at 1-2 rows, 1.4-1.55x faster at 4-8, 1.24x at 16); above that, MKL's GEMM.
    Anything else goes to ``F.linear``: other dtypes or devices, a bias that would
    broadcast, tensors that need gradients or carry a lazy negation, a missing build.
    """
    tensors = (x, weight) if bias is None else (x, weight, bias)
    covered = (x.dim() == 2 and weight.dim() == 2 and weight.is_contiguous()
               and all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.is_neg()
                       for t in tensors)
               and (bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous()))
               and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))
    ops = _ops_for(x.dtype) if covered else None  # the build is only loaded for fp32 CPU
    if ops is None:
        return torch.nn.functional.linear(x, weight, bias)
    return ops.linear(x.contiguous(), weight, bias)


def weight_parts(weight) -> tuple[list[torch.Tensor], list[int], int] | None:
    """A linear weight as the C++ kernels take it: ``(parts, qtypes, cols)``.

    ``weight`` is a dense ``[N, K]`` tensor, a ``quant.QuantizedWeight`` or a tuple of
    them (``quant.fuse_rows``); a dense part becomes GGML type F32 (0). None when a part
    is not covered: a dense part that is not a 2-D fp32 CPU tensor, a quantized one off
    the CPU, or parts of different widths.
    """
    from .quant import QuantizedWeight  # quant imports this module

    if isinstance(weight, QuantizedWeight):  # the common case, kept short (once per call)
        if weight.data.device.type != "cpu":
            return None
        return [weight.data], [weight.qtype.value], weight.shape[1]
    parts: list[torch.Tensor] = []
    qtypes: list[int] = []
    widths: set[int] = set()

    def add(w) -> bool:
        if isinstance(w, tuple):
            return all(add(p) for p in w)
        if isinstance(w, QuantizedWeight):
            if w.data.device.type != "cpu":
                return False
            parts.append(w.data)
            qtypes.append(w.qtype.value)
            widths.add(w.shape[1])
            return True
        if (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32
                and w.device.type == "cpu" and not w.is_neg() and w.stride(-1) == 1):
            parts.append(w)
            qtypes.append(0)
            widths.add(int(w.shape[1]))
            return True
        return False

    if not add(weight) or len(widths) != 1:
        return None
    return parts, qtypes, widths.pop()


#: The optional per-layer weights of ``LlamaDecodeLayers`` (HF names).
OPTIONAL_LAYER_WEIGHTS = ("q_norm", "k_norm", "pre_feedforward_layernorm",
                          "post_feedforward_layernorm")
_LAYER_TUPLE = ("input_layernorm", "post_attention_layernorm", "qkv_proj", "qkv_bias", "o_proj",
                "gate_up_proj", "down_proj")


class LlamaDecodeLayers:
    """A decoder-only model's layers for a step, in one C++ call: decode rows, prompt chunks
    (chunked prefill) or both; a mixed step then stays as cheap as its tokens' GEMM rows
    (bench/mixed_step.py).

    Between two weight-streaming matmuls every small op of the Python forward starts with
    cold caches and costs 30-40 us instead of a few; at batch 1 on the dev machine that
    was about 8 ms of a 35 ms step. The C++ ``LlamaDecodeLayers`` runs the whole layer
    stack (norms, projections through ``linear``'s kernels or the quantized ones, RoPE,
    cache write, paged decode attention, SwiGLU) without returning to Python (the "no
    bubbles" idea of decode megakernels; Hazy Research, "Look Ma, No Bubbles!", 2025).

    One kernel for Llama's block and the families' twists, each a per-layer option:
    Qwen3's per-head Q/K RMSNorm, Gemma's sandwich norms (``pre_/post_feedforward_layernorm``
    given: ``post_attention_layernorm`` then norms the attention output before the
    residual add), GeGLU, sliding windows, per-layer RoPE tables and Gemma 2's
    attention-logit soft-capping.

    Args:
        layers: per layer a mapping by HF name, or the tuple ``(input_layernorm,
            post_attention_layernorm, qkv_proj, qkv_bias, o_proj, gate_up_proj,
            down_proj)``: norms ``[hidden]``, ``qkv_proj [(H + 2 * KVH) * D, hidden]``,
            ``qkv_bias [(H + 2 * KVH) * D]`` or None, ``o_proj [hidden, H * D]``,
            ``gate_up_proj [2 * I, hidden]``, ``down_proj [hidden, I]``; each projection
            a dense fp32 tensor, a ``quant.QuantizedWeight`` or a tuple of parts whose
            outputs are concatenated (``quant.fuse_rows``; Q4_K_M files mix Q4_K and
            Q6_K in QKV). A mapping may add ``OPTIONAL_LAYER_WEIGHTS``: ``q_norm`` and
            ``k_norm`` ``[D]``, the feed-forward norms ``[hidden]`` (both or neither).
            Gemma's ``(1 + weight)`` norms come with the 1 added.
        final_norm: ``[hidden]``.
        num_heads, num_kv_heads, head_dim: attention shape (H, KVH, D).
        eps: RMSNorm epsilon.
        activation: the MLP gate's, ``"silu"`` or ``"gelu_tanh"``.
        attn_logit_softcap: Gemma 2's ``cap * tanh(score / cap)``, or None.
        sliding_windows: per layer keys a query sees (its own included), None for all;
            None: no windows.
        rope_tables: per layer the index of its cos/sin table in ``forward``'s stack;
            None: one table.

    ``available`` is False (and the caller keeps its torch path) unless the norms and
    dense weights are fp32 CPU tensors, quantized ones are on the CPU and the kernels are
    built. ``QUANTIZED_DECODE_LAYERS`` says this class takes quantized projections.

    Raises:
        RuntimeError: (from C++) weights of shapes that do not fit the attention shape.
    """

    def __init__(self, layers, final_norm: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, *, activation: str = "silu",
                 attn_logit_softcap: float | None = None,
                 sliding_windows: list[int | None] | None = None,
                 rope_tables: list[int] | None = None) -> None:
        self._impl = None
        if final_norm.device.type != "cpu":
            return
        ops = _ops_for(final_norm.dtype)
        if ops is None:
            return
        named = []
        for i, layer in enumerate(layers):
            w = dict(zip(_LAYER_TUPLE, layer)) if isinstance(layer, tuple) else layer
            if set(w) - set(_LAYER_TUPLE) - set(OPTIONAL_LAYER_WEIGHTS):
                return  # a weight this kernel does not apply: the caller's loop must run
            small = {name: w[name] for name in ("input_layernorm", "post_attention_layernorm",
                                                "qkv_bias", *OPTIONAL_LAYER_WEIGHTS)
                     if w.get(name) is not None}
            if any(not isinstance(t, torch.Tensor) or t.dtype != torch.float32
                   or t.device.type != "cpu" for t in small.values()):
                return
            projections = {}
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                spec = weight_parts(w[name])
                if spec is None:
                    return
                projections[name] = ops.Projection(parts=spec[0], qtypes=spec[1])
            small.setdefault("qkv_bias", None)
            window = sliding_windows[i] if sliding_windows is not None else None
            named.append(ops.DecoderLayerWeights(
                **small, **projections, sliding_window=window or 0,
                rope_table=rope_tables[i] if rope_tables is not None else 0))
        self._impl = ops.LlamaDecodeLayers(named, final_norm, num_heads, num_kv_heads,
                                           head_dim, eps, activation=activation,
                                           attn_logit_softcap=attn_logit_softcap or 0.0)

    @property
    def available(self) -> bool:
        return self._impl is not None

    def forward(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, plan: attention_plan.AttentionPlan | None,
                scale: float) -> torch.Tensor | None:
        """Run the layers for a step: decode rows, prompt chunks (chunked prefill) or a mix
        of both, every token with a cache slot; otherwise (or without the kernels) return
        None and change nothing.

        Decode rows run the paged decode kernel; each prompt chunk runs the C++ prefill
        attention over its cached prefix and itself (``paged_attention_prefill``).

        Args:
            residual: ``[num_tokens, hidden]`` fp32 token embeddings; overwritten with the
                residual stream.
            cos, sin: ``[num_tokens, head_dim]`` RoPE table rows at the tokens' positions
                (``sin`` holding ``[-sin, sin]``), or ``[num_tables, num_tokens, head_dim]``
                with ``rope_tables``.
            kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
                fp32, fp16, bf16 or fp8 (``--kv-cache-dtype``: K/V rounded to it when
                written, fp8 also saturated: ``reshape_and_cache``).
            plan: this step's ``plan_attention`` (slots and block ids already checked).
            scale: softmax scale.

        Returns:
            ``[num_tokens, hidden]`` hidden states after the final norm, or None.

        Raises:
            ValueError: ``residual`` or ``kv_cache`` does not match the plan.
            RuntimeError: (from C++) a shape, a slot or a block id out of range.
        """
        if (self._impl is None or plan is None or plan.slots is None
                or plan.written_tokens is not None
                or (plan.prefill is not None and plan.seqs is None)
                or residual.dtype != torch.float32
                or kv_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16,
                                          torch.float8_e4m3fn, torch.float8_e5m2)):
            return None
        attention_plan._check_plan(plan, residual, kv_cache[0, 0], kv_cache[0, 1])
        if plan.prefill is None:
            decode = plan.decode
            return self._impl.forward(residual, cos.contiguous(), sin.contiguous(), kv_cache,
                                      plan.slots.contiguous(), decode.block_table,
                                      decode.seq_lens, scale)
        seqs = plan.seqs
        return self._impl.forward(residual, cos.contiguous(), sin.contiguous(), kv_cache,
                                  plan.slots.contiguous(), seqs.block_table, seqs.seq_lens,
                                  scale, seqs.query_start_loc)


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, scale: float, sliding_window: int | None = None,
                      softcap: float | None = None, portable: bool = False) -> torch.Tensor:
    """Paged attention of query chunks, causal over each sequence's cached prefix and its
    chunk, in C++ (``csrc/attention.h`` ``PrefillAttention``: per sequence, KV head and tile
    of up to 16 query tokens, flash-attention's online softmax over spans of 256 keys,
    Dao et al. 2022, section 3.1). On a CPU with AMX-BF16 and the AMX switch on
    (``set_amx``, ``AIOENGINE_AMX``) the products run on AMX tiles (``prefill_amx``),
    fp32-grade bf16 hi + lo or, with ``set_bf16_attention(True)``, plain bf16; otherwise in
    fp32.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` fp32.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` fp32,
            fp16, bf16, float8_e4m3fn or float8_e5m2, already holding the chunks' K/V.
        block_tables: ``[num_seqs, max_blocks]`` int32; seq_lens: ``[num_seqs]`` int32 (the
            chunk included); cu_seqlens_q: ``[num_seqs + 1]`` int32.
        sliding_window: keys a query sees, its own included (HF's mask); None: all.
        softcap: Gemma 2's ``cap * tanh(score / cap)`` before the mask; None: none.
        portable: the portable loops even where the AVX-512 tiles apply (tests).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` fp32.

    Raises:
        RuntimeError: the kernels are not built, or (from C++) a shape, dtype, length or
            block id out of range.
    """
    ops = load()
    if ops is None:
        raise RuntimeError("the C++ CPU kernels are not available")
    out = torch.empty_like(query)
    ops.paged_attention_prefill(out, query, key_cache, value_cache, block_tables.contiguous(),
                                seq_lens.to(torch.int32).contiguous(),
                                cu_seqlens_q.to(torch.int32).contiguous(), scale,
                                sliding_window or 0, softcap or 0.0, portable)
    return out


def sample_from_logits(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                       top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                       uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits[rows]`` by temperature, min-p, top-k, top-p and inverse
    transform sampling with ``uniforms`` (``csrc/sampling.h``; its torch twin
    ``reference.sample_from_logits`` has the shapes). The C++ kernel for fp32 CPU logits
    reads the rows in place: one exp pass and a sample select per filter, no sort of
    the vocabulary. Token ids may differ between the two paths where a uniform falls
    within rounding of a boundary of the cumulative distribution."""
    ops = _ops_for(logits.dtype)
    if ops is None or logits.device.type != "cpu" or logits.dim() != 2 or not _unit_stride(logits):
        return reference.sample_from_logits(logits, rows, temperature, top_k, top_p, min_p,
                                            uniforms)
    return ops.sample_from_logits(logits, rows, temperature, top_k, top_p, min_p, uniforms)


if __name__ == "__main__":  # python -m triton_kernels.cpu_ops: build now and say so
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load()
    print(f"aioengine CPU kernels: {'ready, ' + module.__file__ if module else 'unavailable'}")
