"""``n > 1`` sampling on forked, copy-on-write KV blocks (issue 19's last must-show).

Child 0 prefills the prompt alone; once that step has run, children 1..n-1 fork
its block table, the partial last block included (reference count n), and
compute from the prompt's last token on, so the partial block is copied on
their first write (PagedAttention, Kwon et al. 2023, §4.4).

Two tiers:

- the stand-in model (``tests/factories.py``) behind ``SlotCheckingExecutor``,
  a worker that keeps, per KV slot, the token whose K/V it holds, rebuilds
  every block table from the step messages alone, applies ``copy_blocks``
  before the step's writes, fails any write into a block another request
  holds and any read of a slot that does not hold the reader's token: the
  block-level claims (shared partial block, one copy per sharer before its
  first write, preemption, aborts, seats, the waiting-queue bound);
- a random-weight Qwen2 in process and the shared ``aioengine serve`` test
  server (the default model, the openai client): seeded samples equal the same
  seeds run as separate requests, greedy children equal HF transformers' greedy
  output (near-tie rule of DESIGN.md), and a tiny KV cache that preempts forked
  children changes no sample.
"""

from __future__ import annotations

import shutil

import openai
import pytest
import torch
from parity import assert_greedy_parity

from aioengine import LLM, BeamSearchParams, SamplingParams
from aioengine.core.kv_cache_manager import cdiv
from aioengine.engine.llm_engine import LLMEngine
from aioengine.errors import RequestRejected, SchedulerQueueFull
from aioengine.ipc.messages import ModelRunnerOutput, SchedulerOutput
from tests.factories import FakeExecutor, make_config, make_tokenizer

BS = 4  # make_config's block size


class SlotCheckingExecutor(FakeExecutor):
    """The stand-in model, plus a KV cache of tokens checked at every step.

    Args:
        strict_writes: fail a write into a block more than one request holds.
            Off where requests with one prompt run side by side: a request
            admitted in the same step as the one computing a block may take
            it as a prefix-cache hit and read what the owner writes then.

    Attributes:
        copies: the ``(src, dst)`` pairs it copied, one list per step.
        writes: ``(request id, block id)`` of every write, in order.
    """

    def __init__(self, *args, strict_writes: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.strict_writes = strict_writes
        self.kv = None  # the engine's KVCacheManager, for the ref counts at write time
        self.slots: dict[tuple[int, int], int] = {}
        self.tables: dict[str, list[int]] = {}
        self.copies: list[list[tuple[int, int]]] = []
        self.writes: list[tuple[str, int]] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        computed |= {r.req_id: r.num_computed_tokens for r in so.scheduled_cached_reqs}
        result = super().execute_model(so)  # its token lists cover this step's positions
        for rid in so.finished_req_ids:
            self.tables.pop(rid, None)
        for src, dst in so.copy_blocks:  # before any write, as the worker does
            for offset in range(BS):
                if (src, offset) in self.slots:
                    self.slots[dst, offset] = self.slots[src, offset]
        self.copies.append(list(so.copy_blocks))
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids)
        for cached in so.scheduled_cached_reqs:
            if cached.resumed:
                self.tables[cached.req_id] = list(cached.new_block_ids)
                continue
            table = self.tables[cached.req_id]
            for index, block_id in cached.cow_block_ids:
                table[index] = block_id
            table += cached.new_block_ids
        batch = list(zip(so.req_ids(), so.num_scheduled_tokens))
        for rid, num_new in batch:
            table, tokens = self.tables[rid], self._tokens[rid]
            for pos in range(computed[rid], computed[rid] + num_new):
                block = table[pos // BS]
                ref_cnt = self.kv.block_pool.blocks[block].ref_cnt
                assert ref_cnt == 1 or not self.strict_writes, (
                    f"{rid} writes position {pos} into block {block}, held by {ref_cnt}"
                )
                self.slots[block, pos % BS] = tokens[pos]
                self.writes.append((rid, block))
        for rid, num_new in batch:
            table, tokens = self.tables[rid], self._tokens[rid]
            for pos in range(computed[rid] + num_new):
                held = self.slots.get((table[pos // BS], pos % BS))
                assert held == tokens[pos], (
                    f"{rid} reads position {pos} from block "
                    f"{table[pos // BS]}: {held}, not {tokens[pos]}"
                )
        return result


def make_engine(num_blocks: int = 64, strict_writes: bool = True, **config) -> LLMEngine:
    config.setdefault("num_gpu_blocks_override", num_blocks)
    executor = SlotCheckingExecutor(
        num_blocks=num_blocks, max_model_len=512, strict_writes=strict_writes
    )
    engine = LLMEngine(make_config(**config), make_tokenizer(), executor)
    executor.kv = engine.kv_cache_manager
    return engine


def run(engine: LLMEngine, max_steps: int = 2000) -> dict[str, list[list[int]]]:
    """Step to the end; per request its samples' token ids, by index."""
    samples: dict[str, dict[int, list[int]]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step().request_outputs:
            for c in out.outputs:
                samples.setdefault(out.request_id, {})[c.index] = c.token_ids
    else:
        raise AssertionError(f"not done after {max_steps} steps: {engine.scheduler.running}")
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
    return {rid: [s[i] for i in sorted(s)] for rid, s in samples.items()}


def prompt(length: int, start: int = 0) -> list[int]:
    return [70 + (start + k * 7) % 26 for k in range(length)]


SAMPLED = SamplingParams(temperature=1.0, n=4, seed=5, max_tokens=12, ignore_eos=True)


def separately(params: SamplingParams, prompt_ids: list[int], **config) -> list[list[int]]:
    """The samples of ``params`` as ``n`` separate requests, seed ``seed + i`` each."""
    engine = make_engine(strict_writes=False, **config)
    for i in range(params.n):
        p = SamplingParams(
            temperature=params.temperature,
            seed=params.seed + i,
            max_tokens=params.max_tokens,
            ignore_eos=True,
        )
        engine.add_request(f"r{i}", prompt_ids, p)
    final = run(engine)
    return [final[f"r{i}"][0] for i in range(params.n)]


def test_children_share_the_partial_block_and_copy_it_once_before_writing():
    prompt_ids = prompt(4 * BS + 2)  # 4 full blocks and a partial one of 2 tokens
    engine = make_engine()
    kv, executor = engine.kv_cache_manager, engine.core.executor
    engine.add_request("p", prompt_ids, SAMPLED)
    engine.step()  # child 0 prefills the prompt; the others fork its table after it
    tables = [list(kv.req_to_blocks[f"p#{i}"]) for i in range(4)]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 5
    assert [b.ref_cnt for b in tables[0]] == [4] * 5, "the partial block is shared too"
    assert kv.block_pool.num_used_blocks == 5 and engine.stats().num_kv_blocks_shared == 5
    partial = tables[0][4].block_id
    peak, executor.writes = kv.block_pool.num_used_blocks, []
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, kv.block_pool.num_used_blocks)
    # One copy per sharer of the partial block but the last, which writes in place,
    # all in the step after the fork, each before that sharer's first write (the
    # executor fails any write into a block held by more than one request).
    copies = [pairs for pairs in executor.copies if pairs]
    assert len(copies) == 1 and [src for src, _ in copies[0]] == [partial] * 3
    last_prompt_block = {dst for _, dst in copies[0]} | {partial}
    writers = {(rid, b) for rid, b in executor.writes if b in last_prompt_block}
    assert len(writers) == 4 and len({b for _, b in writers}) == 4, "one block each"
    assert kv.num_cow_copies == 3 and kv.num_forks == 3
    assert kv.block_pool.num_used_blocks == 0
    one_sequence = cdiv(len(prompt_ids) + SAMPLED.max_tokens, BS)
    print(
        f"\nn=4, {len(prompt_ids)}-token prompt, {SAMPLED.max_tokens} tokens each: peak "
        f"{peak} blocks, 4 separate sequences {4 * one_sequence} ({peak / one_sequence:.2f}x "
        "one sequence)"
    )
    assert peak <= 4 + 4 * (one_sequence - 4)


@pytest.mark.parametrize("length", [4 * BS + 2, 4 * BS, 1])
def test_seeded_children_sample_what_separate_requests_with_their_seeds_do(length):
    """Prompt ends mid-block, on a block boundary (the child's rewrite of the last
    prompt token copies a full block), or is one token long."""
    engine = make_engine()
    engine.add_request("p", prompt(length), SAMPLED)
    assert run(engine)["p"] == separately(SAMPLED, prompt(length))
    assert engine.kv_cache_manager.num_forks == 3 and engine.kv_cache_manager.num_cow_copies == 3


@pytest.mark.parametrize("num_blocks", [2, 3, 5])
def test_a_tiny_cache_preempts_forked_children_and_changes_no_sample(num_blocks):
    """With 2 blocks the fork leaves none free: every sharer of the partial block
    needs a copy and none could be preempted (``num_unwritten_shared_blocks``
    counted fork-shared blocks), so the engine idled forever; now sharers are
    preempted and recompute."""
    params = SamplingParams(
        temperature=1.0, n=4, seed=5, max_tokens=num_blocks * BS - 6, ignore_eos=True
    )
    prompt_ids = prompt(6)  # a full block and a partial one
    engine = make_engine(num_blocks=num_blocks)
    engine.add_request("p", prompt_ids, params)
    assert run(engine)["p"] == separately(params, prompt_ids)
    assert engine.stats().num_preemptions > 0 and engine.kv_cache_manager.num_forks == 3


def test_a_child_zero_that_ends_on_its_first_token_still_leaves_its_blocks_to_fork():
    params = SamplingParams(temperature=1.0, n=4, seed=5, max_tokens=1, ignore_eos=True)
    engine = make_engine()
    engine.add_request("p", prompt(10), params)
    assert run(engine)["p"] == separately(params, prompt(10))
    assert engine.kv_cache_manager.num_forks == 3


def test_children_without_a_seat_wait_in_the_queue():
    engine = make_engine(max_num_seqs=2)
    engine.add_request("p", prompt(10), SAMPLED)
    assert run(engine)["p"] == separately(SAMPLED, prompt(10))
    assert engine.stats().max_reqs_in_step == 2
    assert engine.kv_cache_manager.num_forks == 1  # one seat was free after child 0's prefill


def test_abort_before_and_after_the_fork_frees_everything():
    engine = make_engine(max_num_batched_tokens=8)  # the 30-token prompt takes 4 steps
    kv = engine.kv_cache_manager
    for request_id, steps, forks in (("before", 1, 0), ("after", 5, 3)):
        engine.add_request(request_id, prompt(30), SAMPLED)
        forks_before = kv.num_forks
        for _ in range(steps):
            engine.step()
        assert kv.num_forks - forks_before == forks
        assert engine.abort_request(request_id)
        assert not engine.has_unfinished_requests() and engine.stats().num_waiting == 0
        assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
        assert engine.core.get_request(f"{request_id}#3") is None


def test_the_waiting_queue_counts_children_and_beams_before_they_exist():
    engine = make_engine(max_waiting_requests=4)
    engine.add_request("a", prompt(10), SamplingParams(max_tokens=2, n=3))
    assert engine.stats().num_waiting == 3
    with pytest.raises(SchedulerQueueFull):
        engine.add_request("b", prompt(10), SamplingParams(max_tokens=2, n=2))
    with pytest.raises(SchedulerQueueFull):
        engine.add_beam_search_request("c", prompt(10), BeamSearchParams(2, 2))
    engine.add_beam_search_request("d", prompt(10), BeamSearchParams(1, 2))
    assert engine.stats().num_waiting == 4
    assert not engine.output_processor.has_request("b") and "c" not in engine.core.beam_searches


def test_n_beyond_the_whole_waiting_queue_is_refused_not_queue_full():
    """``n`` (or a beam width) above ``max_waiting_requests`` can never be admitted:
    ``RequestRejected`` (400), where ``SchedulerQueueFull`` (429, retry later) had
    clients retry forever on an idle server."""
    engine = make_engine(max_waiting_requests=4)
    with pytest.raises(RequestRejected, match="max_waiting_requests=4") as exc:
        engine.add_request("a", prompt(10), SamplingParams(max_tokens=2, n=5))
    assert exc.value.param == "n"
    with pytest.raises(RequestRejected):
        engine.add_beam_search_request("b", prompt(10), BeamSearchParams(5, 2))
    assert not engine.has_unfinished_requests() and not engine.output_processor.has_request("a")
    engine.add_request("c", prompt(10), SamplingParams(max_tokens=2, n=4))  # fits exactly


# -- a real model ---------------------------------------------------------------------

REAL_BS = 16


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, tokenizer_dir):
    """A random-weight Qwen2 (HF) and an in-process LLM on its saved weights."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = tmp_path_factory.mktemp("qwen2_n")
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    config = Qwen2Config(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.1,
        sliding_window=None,
    )
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(path, safe_serialization=True)
    llm = LLM(str(path), executor="inproc", dtype="float32", block_size=REAL_BS)
    g = torch.Generator().manual_seed(4)
    # Ending mid-block, on a block boundary, and a long one for the block figure.
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (37, 32, 100)]
    yield str(path), hf, llm, prompts
    llm.shutdown()


def real_separately(llm: LLM, params: SamplingParams, prompt_ids: list[int]) -> list[list[int]]:
    singles = [
        SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed + i,
            max_tokens=params.max_tokens,
            ignore_eos=True,
        )
        for i in range(params.n)
    ]
    return [
        out.outputs[0].token_ids
        for out in llm.generate([prompt_ids] * params.n, singles, use_tqdm=False)
    ]


REAL_SAMPLED = SamplingParams(
    temperature=1.0, top_p=0.9, n=4, seed=11, max_tokens=10, ignore_eos=True
)


def test_seeded_samples_on_a_real_model_equal_their_seeds_run_alone(qwen2):
    _, _, llm, prompts = qwen2
    kv = llm.engine.kv_cache_manager
    for prompt_ids in prompts[:2]:
        forks, copies = kv.num_forks, kv.num_cow_copies
        (out,) = llm.generate([prompt_ids], REAL_SAMPLED, use_tqdm=False)
        assert (kv.num_forks - forks, kv.num_cow_copies - copies) == (3, 3)
        samples = [c.token_ids for c in out.outputs]
        assert len({tuple(s) for s in samples}) == 4
        assert samples == real_separately(llm, REAL_SAMPLED, prompt_ids), len(prompt_ids)


def test_greedy_children_equal_hf_greedy(qwen2):
    from parity import hf_greedy

    _, hf, llm, prompts = qwen2
    params = SamplingParams(temperature=0, n=3, max_tokens=24, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts[:2], params, use_tqdm=False)
    ties = []
    for prompt_ids, out in zip(prompts, outputs):
        ref, ref_top2 = hf_greedy(hf, prompt_ids, 24)
        for c in out.outputs:
            top2 = [sorted(lp.values(), reverse=True)[:2] for lp in c.logprobs]
            ties.append(
                assert_greedy_parity(
                    f"{len(prompt_ids)}-token prompt, child {c.index}",
                    c.token_ids,
                    ref,
                    top2,
                    ref_top2,
                )
            )
    assert sum(t is not None for t in ties) <= 1, ties


def test_blocks_after_the_prefill_show_the_shared_partial_block(qwen2):
    _, _, llm, prompts = qwen2
    engine, kv = llm.engine, llm.engine.kv_cache_manager
    prompt_ids = prompts[2]  # 100 tokens: 6 full blocks and 4 tokens
    forks = kv.num_forks
    engine.add_request("blocks", prompt_ids, REAL_SAMPLED)
    engine.step()  # child 0's prefill; the others fork after it
    assert kv.num_forks - forks == 3
    tables = [kv.req_to_blocks[f"blocks#{i}"] for i in range(4)]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 7
    assert [b.ref_cnt for b in tables[0]] == [4] * 7
    partial = tables[0][-1].block_id
    so = engine.schedule()
    assert [src for src, _ in so.copy_blocks] == [partial] * 3
    peak = kv.block_pool.num_used_blocks
    engine.process_output(so, llm.executor.execute_model(so))
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, kv.block_pool.num_used_blocks)
    one_sequence = cdiv(len(prompt_ids) + REAL_SAMPLED.max_tokens, REAL_BS)
    print(
        f"\nn=4 on the random Qwen2, {len(prompt_ids)}-token prompt, "
        f"{REAL_SAMPLED.max_tokens} tokens each: peak {peak} KV blocks, one sequence "
        f"{one_sequence}, 4 unshared {4 * one_sequence} ({peak / one_sequence:.2f}x one)"
    )
    assert peak <= 6 + 4 * (one_sequence - 6) < 4 * one_sequence * 0.6
    assert kv.block_pool.num_used_blocks == 0


def test_a_tiny_kv_cache_preempts_forked_children_and_changes_no_sample(qwen2):
    path, _, roomy, prompts = qwen2
    params = SamplingParams(temperature=1.0, n=4, seed=21, max_tokens=24, ignore_eos=True)
    (expected,) = roomy.generate([prompts[0]], params, use_tqdm=False)
    # 37 + 24 tokens: 4 blocks a sample, 10 with the prompt's 2 full blocks shared.
    tiny = LLM(
        path, executor="inproc", dtype="float32", block_size=REAL_BS, num_gpu_blocks_override=6
    )
    try:
        (out,) = tiny.generate([prompts[0]], params, use_tqdm=False)
        stats = tiny.stats()
        assert stats.num_preemptions > 0 and tiny.engine.kv_cache_manager.num_forks == 3
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in expected.outputs]
        assert stats.num_kv_blocks_used == 0
    finally:
        tiny.shutdown()


# -- the HTTP server --------------------------------------------------------------------


# No child may end at its first token (an EOS draw) before writing into the shared
# partial block: the copy count below would then depend on the seeds' draws.
EVERY_CHILD_WRITES = {"ignore_eos": True}


def test_openai_client_n3_completions_fork_and_keep_each_seed(server):
    """``n: 3`` on /v1/completions through the openai client: three samples, each
    the one its seed (``seed + index``) gives alone, the prompt's partial block
    shared and copied once per sharer but the last."""
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=120
    )
    model = client.models.list().data[0].id
    prompt_text = "Write a short story about a lighthouse keeper and a storm."
    copies = server.stats()["num_cow_copies"]
    together = client.completions.create(
        model=model, prompt=prompt_text, n=3, seed=9, temperature=1.0, max_tokens=10,
        extra_body=EVERY_CHILD_WRITES,
    )
    assert server.stats()["num_cow_copies"] - copies == 2
    texts = [c.text for c in sorted(together.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(together.choices, key=lambda c: c.index)] == [0, 1, 2]
    alone = [
        client.completions.create(
            model=model, prompt=prompt_text, seed=9 + i, temperature=1.0, max_tokens=10,
        extra_body=EVERY_CHILD_WRITES,
        )
        for i in range(3)
    ]
    assert texts == [a.choices[0].text for a in alone] and len(set(texts)) == 3
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    stream = client.completions.create(
        model=model, prompt=prompt_text, n=3, seed=9, temperature=1.0, max_tokens=10, stream=True,
        extra_body=EVERY_CHILD_WRITES,
    )
    streamed = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
