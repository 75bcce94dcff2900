"""``aioengine.structured`` and its engine/worker hooks, without a server:
the params, the compile cache and its errors, the bitmask the manager fills
against xgrammar's own, the worker's vectorised mask against xgrammar's
``apply_token_bitmask_inplace``, and the scheduler letting a request wait for
its grammar while others run."""

from __future__ import annotations

import json
from concurrent.futures import Future

import numpy as np
import pytest
import torch
import xgrammar as xgr

from aioengine.config import default_model_path
from aioengine.models.loader import load_tokenizer
from aioengine.structured import GrammarError, StructuredOutputsParams
from aioengine.structured.manager import StructuredOutputManager
from aioengine.structured.request import StructuredOutputRequest
from aioengine.worker.sampler import apply_grammar_bitmask

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                           "age": {"type": "integer"}},
          "required": ["kind", "age"]}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def manager(tokenizer):
    m = StructuredOutputManager(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    yield m
    m.shutdown()


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError):
        StructuredOutputsParams()
    with pytest.raises(ValueError):
        StructuredOutputsParams(regex="a", grammar="root ::= \"a\"")
    with pytest.raises(ValueError):
        StructuredOutputsParams(choice=())
    assert StructuredOutputsParams(json=SCHEMA).key() == \
        StructuredOutputsParams(json=json.dumps(SCHEMA, separators=(",", ":"))).key()


@pytest.mark.parametrize("params", [
    StructuredOutputsParams(json={"type": "objec"}), StructuredOutputsParams(json="{"),
    StructuredOutputsParams(regex="(a"), StructuredOutputsParams(grammar="root ::= nope"),
])
def test_an_uncompilable_constraint_raises_grammar_error_without_the_cpp_location(manager,
                                                                                   params):
    with pytest.raises(GrammarError) as info:
        manager.compile_sync(params)
    assert "/project/cpp" not in str(info.value) and str(info.value)


def test_compiles_are_cached_by_key(manager):
    a = manager.compile(StructuredOutputsParams(json=SCHEMA))
    b = manager.compile(StructuredOutputsParams(json=dict(SCHEMA)))
    assert a is b
    assert manager.compile(StructuredOutputsParams(regex="x+")) is not a


def test_the_bitmask_rows_are_the_grammars_next_tokens(manager, tokenizer):
    reqs = [manager.new_request(StructuredOutputsParams(choice=("yes", "no"))),
            manager.new_request(StructuredOutputsParams(json=SCHEMA))]
    for r in reqs:
        r.grammar_future.result()
        assert r.is_ready()
    mask = manager.grammar_bitmask(reqs)
    assert mask.dtype == np.int32 and mask.shape == (2, (len(tokenizer) + 31) // 32)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little").reshape(2, -1)
    allowed = [set(np.flatnonzero(row).tolist()) for row in bits]
    texts = {tokenizer.decode([t]) for t in allowed[0]}
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts) and texts
    assert {tokenizer.decode([t]) for t in allowed[1]} <= {"{", " {"} | {
        tokenizer.decode([t]) for t in allowed[1] if tokenizer.decode([t]).startswith("{")}
    # Advance the first one to its end: then only EOS is allowed.
    for t in tokenizer.encode("yes", add_special_tokens=False):
        assert reqs[0].accept_token(t)
    bits = np.unpackbits(manager.grammar_bitmask(reqs[:1]).view(np.uint8),
                         bitorder="little")
    assert np.flatnonzero(bits).tolist() == [tokenizer.eos_token_id]
    assert reqs[0].accept_token(tokenizer.eos_token_id) and reqs[0].is_terminated


def test_the_worker_mask_matches_xgrammars_own_and_leaves_other_rows_alone():
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, (vocab + 31) // 32), dtype=torch.int32,
                            generator=gen)
    rows = torch.tensor([3, 1])
    ours = logits.clone()
    apply_grammar_bitmask(ours, rows, bitmask)
    ref = logits.clone()
    full = torch.full((5, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask  # xgrammar's indices pick rows of both logits and mask
    xgr.apply_token_bitmask_inplace(ref, full, indices=rows.tolist())
    assert torch.equal(ours, ref)
    for free in (0, 2, 4):
        assert torch.equal(ours[free], logits[free])


def test_columns_past_the_mask_are_forbidden():
    logits = torch.zeros(1, 40)
    apply_grammar_bitmask(logits, torch.tensor([0]), torch.full((1, 1), -1, dtype=torch.int32))
    assert torch.isinf(logits[0, 32:]).all() and not torch.isinf(logits[0, :32]).any()


def test_a_request_whose_grammar_is_compiling_waits_while_others_run(tokenizer):
    from aioengine.config import EngineConfig
    from aioengine.engine.core import EngineCore
    from aioengine.engine.input_processor import EngineCoreRequest
    from aioengine.sampling_params import SamplingParams
    from aioengine.structured.manager import StructuredOutputManager

    class NoExecutor:  # the core only reads the handshake's sizes here
        num_blocks, max_model_len = 64, 2048

    config = EngineConfig.from_kwargs(model=default_model_path())
    core = EngineCore(config, NoExecutor(), StructuredOutputManager(  # type: ignore[arg-type]
        tokenizer, len(tokenizer), tokenizer.eos_token_id), tokenizer.eos_token_id)

    def add_request(request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        core.add_requests([EngineCoreRequest(request_id, token_ids, params, params.max_tokens)])

    slow: Future = Future()
    add_request("constrained", [1, 2, 3], SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+")))
    core.scheduler.requests["constrained"].structured_output_request = \
        StructuredOutputRequest(StructuredOutputsParams(regex="a+"), slow,
                                core.structured_output_manager.backend)
    add_request("free", [4, 5, 6], SamplingParams(max_tokens=4))
    so = core.schedule()
    assert so.req_ids() == ["free"] and so.grammar_bitmask is None
    assert core.pending_grammars() == [slow]
    slow.set_result(core.structured_output_manager.compile(
        StructuredOutputsParams(regex="a+")).result())
    so = core.schedule()
    assert so.req_ids() == ["constrained", "free"]
    assert so.structured_output_request_ids == ["constrained"]
    words = (len(tokenizer) + 31) // 32
    assert len(so.grammar_bitmask) == 4 * words


# -- a grammar that allows only EOS while min_tokens bans it (structured/min_tokens.py) ------


def test_min_tokens_is_lifted_only_where_the_grammar_allows_nothing_else(manager, tokenizer):
    from aioengine.structured.min_tokens import lift_min_tokens_where_grammar_ends
    from aioengine.worker.sampler import SamplingBatch, sample

    eos = tokenizer.eos_token_id
    done = manager.new_request(StructuredOutputsParams(json={"type": "boolean"}))
    going = manager.new_request(StructuredOutputsParams(json={"type": "boolean"}))
    done.grammar_future.result()
    assert done.is_ready() and going.is_ready()
    for t in tokenizer.encode("true", add_special_tokens=False):
        assert done.accept_token(t)  # complete: only EOS may follow
    bitmask = torch.from_numpy(manager.grammar_bitmask([done, going]))
    # rows 0 and 2 are under min_tokens (EOS and a user stop id banned), row 1 is not
    min_mask = (torch.tensor([0, 0, 2, 2]), torch.tensor([eos, 7, eos, 7]))
    grammar = (torch.tensor([0, 2]), bitmask)
    rows, ids = lift_min_tokens_where_grammar_ends(min_mask, grammar)
    assert rows.tolist() == [2, 2] and ids.tolist() == [eos, 7]  # "going" keeps min_tokens
    assert lift_min_tokens_where_grammar_ends(min_mask, None) is min_mask

    # Through the sampler: the complete grammar's row samples EOS, greedy or not.
    vocab = bitmask.shape[1] * 32
    for temperature in (0.0, 1.0):
        logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3))
        n = 3
        batch = SamplingBatch(
            temperature=torch.full((n,), temperature), top_p=torch.ones(n),
            top_k=torch.zeros(n, dtype=torch.int64), min_p=torch.zeros(n),
            presence_penalty=torch.zeros(n), frequency_penalty=torch.zeros(n),
            repetition_penalty=torch.ones(n),
            generators=[torch.Generator().manual_seed(i) for i in range(n)],
            greedy=[temperature == 0] * n, num_logprobs=[-1] * n,
            all_greedy=temperature == 0, grammar_bitmask=grammar,
            min_tokens_mask=lift_min_tokens_where_grammar_ends(min_mask, grammar))
        tokens, _ = sample(logits, batch)
        assert tokens[0] == eos
        assert going.matcher.accept_token(int(tokens[2])), "row 2 left its grammar"
        going.matcher.rollback(1)


def test_a_token_the_grammar_forbids_is_never_emitted():
    """The stand-in model ignores every mask and picks letters; a grammar of digits
    rejects its first token, which must end the request without being emitted (not
    show up in the text, the token ids or a stream)."""
    from aioengine import SamplingParams
    from tests.factories import make_llm

    llm = make_llm()
    try:
        p = SamplingParams(temperature=0, max_tokens=8,
                           structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"))
        out = llm.generate(["count: "], p, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.text, out.finish_reason) == ([], "", "stop")
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()
