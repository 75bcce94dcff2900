"""Adversarial tests of the one-pass decode attention kernel (csrc/attention.h, ``attn512::run``
and the portable kernel), against an fp64 loop oracle written here, independent of
``reference.py`` (which is checked too, where it takes the case).

What a wrong blocked kernel would get wrong, and the cases that pin it: the 16-key chunks
and 4-key quads (lengths 1, 3, 15, 16, 17, 33 and block sizes that do not divide them), the
3-head score tiles and 64-dim value tiles (groups 1, 4-7, 9, 16 and head_dim 16-256), the
rescale only when the running max grows (logits rising, falling, constant, in stairs,
+-1e4, one spike), a chunk whose scores all overflow to -inf, the window (1, inside a
block, == and > seq_len) and the soft-cap, the split of tasks over threads (1-70
sequences, a long one among short ones), block tables that share, repeat and pad ids,
strided operands, and bad input, which must raise a RuntimeError instead of reading out
of bounds.

Tolerances. Scores, softmax and sums are fp32 in the kernel and fp64 in the oracle, both
on the same (widened) cache values, so the cache dtype adds no error of its own. With
O(1) scores the error is a few fp32 roundings of the output: over the random cases here
(every group, head_dim, cache dtype, block sizes 16 and 5) at most 2.8e-6 (blocked) and
3.4e-6 (portable) observed, and 6.6e-6 for reference.py's SDPA: ``ATOL`` 1e-5. The
logit-profile cases build scores that are exact in fp32 (q = e0, k[0] the logit, scale 1),
so even +-1e4 logits keep that tolerance. Where scores are large and inexact (scale 100),
an error of delta in a score moves the output by at most 2 * delta * max|v|, and delta is
a few fp32 roundings of the score's absolute terms: ``_score_budget``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from triton_kernels import cpu_ops, reference

pytestmark = pytest.mark.skipif(cpu_ops.load() is None,
                                reason="the C++ CPU kernels did not build here")

ATOL = 1e-5
INT32_MAX = 2**31 - 1
KERNELS = ("blocked", "portable")  # portable=True forces the portable kernel
# Lengths around the chunk (16) and quad (4) edges, and several chunks with a ragged tail.
LENS = [1, 3, 15, 16, 17, 33, 130]


def _ops():
    return cpu_ops.load()


def oracle(query, key_cache, value_cache, block_tables, seq_lens, scale, window=0,
           softcap=0.0):
    """Decode attention in fp64, walking each sequence's block table position by
    position. ``[num_seqs, num_heads, head_dim]`` float64."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float64)
    for s in range(num_seqs):
        seq_len = int(seq_lens[s])
        first = seq_len - window if 0 < window < seq_len else 0
        pos = torch.arange(first, seq_len)
        blocks = block_tables[s].long()[pos // block_size]
        k = key_cache[blocks, pos % block_size].double()  # [n, kv_heads, head_dim]
        v = value_cache[blocks, pos % block_size].double()
        q = query[s].double().view(num_kv_heads, group, head_dim)
        scores = torch.einsum("hgd,nhd->hgn", q, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out[s] = torch.einsum("hgn,nhd->hgd", scores.softmax(-1), v).reshape(num_heads, -1)
    return out


def make_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size,
              cache_dtype=torch.float32, seed=0, padding=-1):
    """Random query and caches, shuffled block ids; table padding holds ``padding``
    (never read) and there is a spare column."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [max(1, -(-n // block_size)) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(blocks_per_seq) + 1), padding, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return {
        "query": torch.randn(len(seq_lens), num_heads, head_dim, generator=gen),
        "key_cache": torch.randn(shape, generator=gen).to(cache_dtype),
        "value_cache": torch.randn(shape, generator=gen).to(cache_dtype),
        "block_tables": table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
    }


def run(case, scale, kernel="blocked", window=0, softcap=0.0, out=None):
    """The kernel's output, written into a NaN-filled tensor (a row it skips stays NaN)."""
    if out is None:
        out = torch.full_like(case["query"], float("nan"))
    _ops().paged_attention_decode(out, case["query"], case["key_cache"], case["value_cache"],
                                  case["block_tables"], case["seq_lens"], scale,
                                  kernel == "portable", window, softcap)
    return out


def torch_reference(case, scale):
    """reference.py's gather + SDPA decode on the widened cache (no window, no cap)."""
    num_blocks = case["key_cache"].shape[0]
    return reference.paged_attention_decode(
        case["query"], case["key_cache"].float(), case["value_cache"].float(),
        case["block_tables"].clamp(0, num_blocks - 1), case["seq_lens"], scale,
        int(case["seq_lens"].max()))


def assert_matches(out, expected, atol=ATOL):
    err = (out.double() - expected.double()).abs().max().item()
    assert err <= atol, f"max abs error {err:.3g} > {atol:.3g}"


@pytest.fixture
def threads():
    """Sets torch's thread count for the test (the kernel splits tasks over them)."""
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


# (num_heads, num_kv_heads): groups 1, 4, 5, 6, 7, 9 (three 3-head tiles), 16 (five and a
# remainder), on 1 and 2 KV heads.
GROUPS = [(1, 1), (4, 1), (10, 2), (6, 1), (14, 2), (9, 1), (32, 2)]


@pytest.mark.parametrize("head_dim", [16, 32, 80, 96, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", GROUPS)
def test_decode_matches_fp64_oracle_across_groups_and_head_dims(num_heads, num_kv_heads,
                                                                head_dim, threads):
    # fp32/fp16/bf16 caches and block sizes 16/5/1 in turn: every dtype meets every head_dim
    # once per group column; 1 and 2 threads; both kernels.
    i = GROUPS.index((num_heads, num_kv_heads)) + head_dim
    cache_dtype = (torch.float32, torch.float16, torch.bfloat16)[i % 3]
    block_size = (16, 5, 1)[i % 3]
    case = make_case(LENS, num_heads, num_kv_heads, head_dim, block_size, cache_dtype, seed=i)
    scale = 3 * head_dim ** -0.5  # sharper than usual: a dropped or mis-weighted key shows
    expected = oracle(**case, scale=scale)
    assert_matches(torch_reference(case, scale), expected)
    for num_threads, kernel in itertools.product((1, 2), KERNELS):
        threads(num_threads)
        assert_matches(run(case, scale, kernel), expected)


def _profile_case(seq_lens, logit, num_heads, num_kv_heads, head_dim, cache_dtype):
    """Scores exact in fp32: q = e0 at scale 1 and k[0] = logit(position, seq_len)."""
    case = make_case(seq_lens, num_heads, num_kv_heads, head_dim, 16, seed=7)
    case["query"].zero_()[:, :, 0] = 1.0
    key_cache = torch.zeros(case["key_cache"].shape)
    for s, seq_len in enumerate(seq_lens):
        for p in range(seq_len):
            key_cache[int(case["block_tables"][s, p // 16]), p % 16, :, 0] = logit(p, seq_len)
    case["key_cache"] = key_cache.to(cache_dtype)
    case["value_cache"] = case["value_cache"].to(cache_dtype)
    return case


# Logits along the sequence (all representable in bf16, so exact in every cache dtype).
PROFILES = {
    "rising": lambda p, n: p * 0.5,  # the max grows every chunk: rescale each time
    "rising_steep": lambda p, n: p * 32.0,  # old chunks' weights underflow to 0
    "falling": lambda p, n: -p * 0.5,  # the first chunk holds the max
    "constant": lambda p, n: 3.0,  # ties: never rescale after the first chunk
    "alternating_1e4": lambda p, n: 1e4 if p % 2 else -1e4,
    "spike_last": lambda p, n: 1e4 if p == n - 1 else -1e4,
    "spike_first": lambda p, n: 1e4 if p == 0 else 0.0,
    "stairs": lambda p, n: (p // 16) * 8.0,  # a new max at each chunk's first key
    "rising_in_chunk": lambda p, n: (p % 16) * 4.0,  # the max at each chunk's last key
}


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_decode_online_softmax_survives_logit_profiles(profile, cache_dtype, threads):
    # Windows 1 (one key: the output is that key's V), 17 (inside a block), seq_len and
    # beyond; soft-cap 30 on 1e4 logits (saturated tanh: near-ties everywhere).
    seq_lens = [1, 16, 17, 100, 333]
    case = _profile_case(seq_lens, PROFILES[profile], 9, 3, 80, cache_dtype)
    for window, softcap in ((0, 0.0), (1, 0.0), (17, 0.0), (333, 0.0), (1000, 0.0),
                            (0, 30.0), (5, 1.0)):
        expected = oracle(**case, scale=1.0, window=window, softcap=softcap)
        for num_threads, kernel in ((1, "blocked"), (2, "blocked"), (2, "portable")):
            threads(num_threads)
            assert_matches(run(case, 1.0, kernel, window, softcap), expected)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("num_heads", [1, 3, 4])
@pytest.mark.parametrize("overflowed", [3, 16, 20, 32])
def test_decode_overflowed_scores_do_not_poison_the_later_keys(overflowed, num_heads, kernel):
    # Keys whose scores overflow fp32 to -inf (q0 * k0 = -2^132) weigh 0, as in torch's
    # softmax and the fp64 oracle (where -2^132 is finite): the later keys keep their
    # weights. Scores are exact: -2^66 * (p % 5) * 2^-66 = -(p % 5).
    # The blocked kernel used to start each head's running max at -inf and, on a first
    # chunk with no finite score, took exp(-inf - -inf) = NaN into its sums.
    seq_len = 40
    case = make_case([seq_len], num_heads, 1, 64, 16, seed=overflowed)
    case["query"].zero_()[:, :, 0] = -(2.0**66)
    key_cache = torch.zeros(case["key_cache"].shape)
    for p in range(seq_len):
        key_cache[int(case["block_tables"][0, p // 16]), p % 16, :, 0] = (
            2.0**66 if p < overflowed else (p % 5) * 2.0**-66)
    case["key_cache"] = key_cache
    out = run(case, 1.0, kernel)
    assert torch.isfinite(out).all(), "a chunk of -inf scores turned the output into NaN"
    assert_matches(out, oracle(**case, scale=1.0))
    assert_matches(out, torch_reference(case, 1.0))


def test_decode_task_split_over_threads_changes_no_bit(threads):
    # 1-70 sequences, a 2,500-token one among short ones: at 2 threads from 8 sequences on a
    # blocked task takes every KV head of its sequence, below it one; neither the split nor
    # the task shape may change the per-head arithmetic, so outputs are bitwise equal.
    lens_pool = [1, 2, 15, 16, 17, 31, 64, 200, 511]
    for num_seqs in (1, 3, 4, 7, 8, 9, 33, 70):
        seq_lens = [lens_pool[(7 * i + num_seqs) % len(lens_pool)] for i in range(num_seqs)]
        if num_seqs == 9:
            seq_lens[3] = 2500
        case = make_case(seq_lens, 6, 2, 32, 16, seed=num_seqs)
        expected = oracle(**case, scale=0.5)
        for kernel in KERNELS:
            threads(1)
            single = run(case, 0.5, kernel)
            assert_matches(single, expected)
            for num_threads in (2, 3):
                threads(num_threads)
                assert torch.equal(run(case, 0.5, kernel), single), (num_seqs, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_decode_block_tables_shared_repeated_and_padded(kernel):
    # Blocks shared by every sequence (a common prefix), an id repeated inside one table,
    # ids in descending order, and padding of -1 and INT32_MAX past each sequence's last
    # block (never read). Block size 5: lengths cross blocks at odd offsets.
    case = make_case([40, 40, 33, 1, 12], 4, 2, 64, 5, seed=3)
    table = case["block_tables"]
    table[1, :8] = table[0, :8]
    table[2, :7] = table[0, :7]
    table[0, 2] = table[0, 5]
    table[4, :3] = torch.tensor([10, 9, 8], dtype=torch.int32)
    table[3, 1:] = INT32_MAX
    for scale in (0.125, 1.0):
        expected = oracle(**case, scale=scale)
        assert_matches(run(case, scale, kernel), expected)
        assert_matches(torch_reference(case, scale), expected)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_decode_strided_operands(cache_dtype, kernel):
    # Every stride but head_dim's is free: query and out as slices of larger tensors (the
    # out rows around them stay untouched), caches as one layer's slice of a
    # [layers, 2, ...] tensor, in [blocks, kv_heads, block_size, head_dim] memory order, and
    # one KV head expanded to two (stride 0).
    case = make_case([5, 17, 70], 8, 2, 64, 16, cache_dtype, seed=4)
    query = torch.randn(3, 16, 128)[:, ::2, 32:96]
    big_out = torch.full((3, 8, 3, 64), float("nan"))
    k, v = case["key_cache"], case["value_cache"]
    kv = torch.randn(2, 2, *k.shape).to(cache_dtype)
    layouts = {
        "layer_slice": (kv[1, 0], kv[1, 1]),
        "head_major": tuple(c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k, v)),
        "expanded_head": tuple(c[:, :, :1].expand(-1, -1, 2, -1) for c in (k, v)),
    }
    for key_cache, value_cache in layouts.values():
        strided = {**case, "query": query, "key_cache": key_cache, "value_cache": value_cache}
        run(strided, 0.2, kernel, out=big_out[:, :, 1])
        assert_matches(big_out[:, :, 1], oracle(**strided, scale=0.2))
        assert big_out[:, :, 0].isnan().all() and big_out[:, :, 2].isnan().all()


def _score_budget(case, scale):
    """2 * max|v| * (a few fp32 roundings of each score's absolute terms): how far fp32
    scores may move the output from the fp64 oracle (see the module docstring)."""
    abs_terms = (case["query"].abs().amax() * case["key_cache"].float().abs().amax()
                 * case["query"].shape[-1] * abs(scale))
    return ATOL + 2 * case["value_cache"].float().abs().amax().item() * 4 * 2**-24 * abs_terms


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("scale", [0.0, 1e-30, 1e-3, -1.0, 10.0, 100.0])
def test_decode_scale_extremes(scale, kernel):
    # 0 and 1e-30 (q * scale underflows): the plain mean of V; negative: a flipped order of
    # the keys; 100: a near-argmax softmax over scores of several hundred.
    case = make_case([1, 17, 300], 8, 2, 64, 16, seed=1)
    assert_matches(run(case, scale, kernel), oracle(**case, scale=scale),
                   atol=float(_score_budget(case, scale)))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_decode_degenerate_values_are_exact(cache_dtype, kernel):
    case = make_case([1, 17, 300], 9, 3, 64, 16, cache_dtype, seed=2)
    # All-zero V: exactly 0 whatever the weights.
    zero_v = {**case, "value_cache": torch.zeros_like(case["value_cache"])}
    assert torch.equal(run(zero_v, 0.3, kernel), torch.zeros_like(case["query"]))
    # Window 1: the weight of the last key is exp(0) / 1 = 1, so the output is its V, bit
    # for bit.
    last = torch.stack([
        case["value_cache"][int(case["block_tables"][s, (n - 1) // 16]), (n - 1) % 16]
        for s, n in enumerate(case["seq_lens"].tolist())]).float()
    expected = last.repeat_interleave(3, dim=1)
    assert torch.equal(run(case, 0.3, kernel, window=1), expected)
    # Identical keys: uniform weights, the mean of V over the sequence.
    same_k = {**case, "key_cache": case["key_cache"][:1, :1].expand_as(case["key_cache"])}
    assert_matches(run(same_k, 5.0, kernel), oracle(**same_k, scale=5.0), atol=2e-6)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("window", [1, 5, 16, 17, 33])
def test_decode_window_never_reads_keys_before_it(window, kernel):
    # NaN in every K and V row before each sequence's window (in blocks it partly reads and
    # in blocks wholly before it): a kernel that read one would return NaN. Then the table
    # entries of the blocks wholly before the window become -1 (a freed block, as a
    # sliding-window cache may free them): neither read nor refused.
    case = make_case([40, 100, 17], 4, 2, 64, 16, seed=4)
    expected = oracle(**case, scale=0.125, window=window)
    for s, n in enumerate(case["seq_lens"].tolist()):
        for p in range(max(0, n - window)):
            block = int(case["block_tables"][s, p // 16])
            case["key_cache"][block, p % 16] = float("nan")
            case["value_cache"][block, p % 16] = float("nan")
    assert_matches(run(case, 0.125, kernel, window=window), expected)
    for s, n in enumerate(case["seq_lens"].tolist()):
        case["block_tables"][s, :max(0, n - window) // 16] = -1
    assert_matches(run(case, 0.125, kernel, window=window), expected)


@pytest.mark.parametrize("dtype,rel", [(torch.bfloat16, 2**-8), (torch.float16, 2**-11),
                                       (torch.float64, 0.0)])
def test_decode_same_dtype_queries_round_once(dtype, rel):
    # bf16/fp16/fp64 queries with a cache of their dtype take the portable kernel (fp32
    # inside): within one rounding of the output dtype (rel * max|out|) and fp32's ATOL.
    case = make_case([1, 17, 90], 6, 2, 64, 16, seed=3)
    case = {**case, **{name: case[name].to(dtype)
                       for name in ("query", "key_cache", "value_cache")}}
    expected = oracle(**case, scale=0.125)
    out = run(case, 0.125)
    assert out.dtype == dtype
    assert_matches(out, expected, atol=ATOL + rel * expected.abs().max().item())


@pytest.mark.parametrize("kernel", KERNELS)
def test_decode_empty_sequence_gives_zeros(kernel):
    # seq_len 0 (no keys): zeros, not NaN, and the other rows unchanged.
    case = make_case([40, 1, 17], 4, 2, 64, 16, seed=6)
    expected = oracle(**case, scale=0.125)
    case["seq_lens"][1] = 0
    out = run(case, 0.125, kernel)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_matches(out[[0, 2]], expected[[0, 2]])


def _bad_inputs():
    """(name, change to a valid case, error text): input the kernel must refuse."""
    def seq_lens(*lens):
        return lambda c: c.update(seq_lens=torch.tensor(lens, dtype=torch.int32))

    def block(row, col, value):
        def change(c):
            c["block_tables"][row, col] = value
        return change

    def cache(index):
        return lambda c: c.update(key_cache=c["key_cache"][index],
                                  value_cache=c["value_cache"][index])

    return [
        ("seq_len_past_the_table", seq_lens(17, 4 * 16 + 1), "seq_len"),
        ("seq_len_far_past_the_table", seq_lens(17, 10**6), "seq_len"),
        ("negative_seq_len", seq_lens(17, -5), "seq_len"),
        ("negative_block_id", block(1, 0, -1), "block id"),
        ("most_negative_block_id", block(1, 1, -2**31), "block id"),
        ("block_id_past_the_cache", block(1, 1, 10**6), "block id"),
        ("block_id_equal_to_num_blocks", block(0, 1, 7), "block id"),
        ("no_kv_heads", cache((slice(None), slice(None), slice(0, 0))), "num_kv_heads"),
        ("no_block_size", cache((slice(None), slice(0, 0))), "block_size"),
        ("empty_cache", cache(slice(0, 0)), "block id"),
        ("int64_block_tables", lambda c: c.update(block_tables=c["block_tables"].long()),
         "int32"),
        ("one_dim_block_tables",
         lambda c: c.update(block_tables=c["block_tables"][:, 0].contiguous()), "block_tables"),
        ("fp16_query_fp32_cache", lambda c: c.update(query=c["query"].half()), "dtype"),
        ("head_mismatch", lambda c: c.update(query=torch.randn(2, 5, 64)), "head"),
    ]


@pytest.mark.parametrize("name,change,match", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_decode_rejects_bad_input_with_a_python_error(name, change, match):
    # Before the checks, a seq_len past the table or a block id outside the cache read out
    # of bounds (a segfault, or silently garbage for -1 and num_blocks), zero KV heads or
    # block size divided by zero (SIGFPE), and a negative seq_len surfaced as
    # "vector::_M_default_append".
    case = make_case([17, 40], 4, 2, 64, 16, seed=1)  # 7 blocks, 4 table columns
    change(case)
    out = torch.empty(case["query"].shape, dtype=case["query"].dtype)
    with pytest.raises(RuntimeError, match=match):
        run(case, 0.125, out=out)


# -- prefill, through its public entry (cpu_ops.prefill_attention) ---------------------------


def prefill_oracle(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                   window=0):
    """Causal (and windowed) attention of each sequence's last q_len positions, fp64."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    for s, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        pos = torch.arange(seq_len)
        blocks = block_tables[s].long()[pos // block_size]
        k = key_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)
        v = value_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)
        q_pos = torch.arange(seq_len - (q1 - q0), seq_len)[:, None]
        allowed = (pos[None] <= q_pos) & ((pos[None] > q_pos - window) if window else True)
        scores = torch.einsum("qhd,khd->hqk", query[q0:q1].double(), k) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


@pytest.mark.parametrize("portable", [False, True])
def test_prefill_rising_and_overflowed_logits_across_spans(portable):
    # Chunks whose keys cross the prefill kernel's 256-key spans, with logits rising along
    # the sequence (a new max every span) and, in one sequence, the first 256 keys' scores
    # overflowing fp32 to -inf (-2^66 * 2^66: a whole span weighing 0). Scores exact in
    # fp32 (as in the decode case above): ATOL.
    chunks = [(20, 600), (3, 260), (2, 300)]
    q_lens, seq_lens = zip(*chunks)
    case = make_case(list(seq_lens), 4, 2, 64, 16, seed=3)
    num_tokens = sum(q_lens)
    query = torch.zeros(num_tokens, 4, 64)
    query[:, :, 0] = 1.0
    query[23:, :, 0] = -(2.0**66)
    key_cache = torch.zeros(case["key_cache"].shape)
    for s, seq_len in enumerate(seq_lens):
        for p in range(seq_len):
            logit = p * 0.7 if s < 2 else (2.0**66 if p < 256 else (p % 5) * 2.0**-66)
            key_cache[int(case["block_tables"][s, p // 16]), p % 16, :, 0] = logit
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    args = dict(query=query, key_cache=key_cache, value_cache=case["value_cache"],
                block_tables=case["block_tables"].clamp(min=0), seq_lens=case["seq_lens"],
                cu_seqlens_q=cu, scale=1.0)
    for window in (0, 1, 100):
        out = cpu_ops.prefill_attention(**args, sliding_window=window or None,
                                        portable=portable)
        assert_matches(out, prefill_oracle(**args, window=window))
