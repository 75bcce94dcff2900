"""The offline API, written the way vLLM users write it::

    from aioengine import LLM, SamplingParams
    llm = LLM(model="path/to/model.gguf")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.8, max_tokens=256))
"""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from aioengine.config import EngineConfig
from aioengine.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from aioengine.engine.core import EngineCore
from aioengine.engine.executor import make_executor
from aioengine.models.loader import inspect_model, load_tokenizer
from aioengine.sampling_params import CompletionOutput, RequestOutput, SamplingParams


class LLM:
    """Batch generation with continuous batching, no server.

    Args:
        model: ``.gguf`` file or HF folder; empty for the default SmolLM2.
        **kwargs: any ``EngineConfig`` field (``dtype``, ``quantization``,
            ``block_size``, ``max_num_seqs``, ``executor`` ...).

    Raises:
        ValueError: a bad engine argument, or a model the loader refuses from its
            metadata (not GGUF, corrupt, unsupported architecture or tensor type).
    """

    def __init__(self, model: str = "", **kwargs: object) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        m = self.config.model
        self.model_info = inspect_model(m.model_path, m.quantization, m.dtype)
        self.tokenizer = load_tokenizer(m.model_path)
        self.executor = make_executor(self.config)
        self.engine = EngineCore(self.config, self.tokenizer, self.executor.num_blocks,
                                 self.executor.max_model_len)
        self._counter = 0

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Args:
            prompts: strings, or token-id lists.
            sampling_params: one for all prompts or one per prompt.
            priority: per prompt, lower first.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            token_ids = (self.tokenizer.encode(prompt) if isinstance(prompt, str)
                         else list(prompt))
            if p.structured_outputs is not None:  # GrammarError for a bad one, before queueing
                self.engine.structured_output_manager.compile_sync(p.structured_outputs)
            request_id = str(self._counter)
            self._counter += 1
            self.engine.add_request(request_id, token_ids, p,
                                    priority=priority[i] if priority else 0)
            ids.append(request_id)
        final = self._run(ids, use_tqdm)
        return [final[i] for i in ids]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True
             ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                   for c in convs]
        token_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_ids, sampling_params, use_tqdm)

    def beam_search(self, prompts: str | Sequence[str | list[int] | dict],
                    params: BeamSearchParams, use_tqdm: bool = False
                    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt, as vLLM's ``LLM.beam_search``; all prompts run
        together, their beams sharing KV blocks copy-on-write.

        Args:
            prompts: strings, token-id lists, or vLLM prompt dicts (``{"prompt": ...}``
                or ``{"prompt_token_ids": [...]}``).
            params: beam width, max_tokens, length_penalty, early_stopping ...

        Returns:
            Per prompt, ``sequences``: the ``beam_width`` best beams, best first, each
            with ``tokens`` (prompt and output), ``text`` (the output, EOS left out),
            ``cum_logprob`` and ``finish_reason``.

        Raises:
            RequestRejected: a prompt that can never run (too long for the context).
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = []
        for prompt in prompts:
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids") or prompt["prompt"]
            token_ids = (self.tokenizer.encode(prompt) if isinstance(prompt, str)
                         else list(prompt))
            request_id = str(self._counter)
            self._counter += 1
            self.engine.add_beam_search_request(request_id, token_ids, params)
            ids.append(request_id)
        final = self._run(ids, use_tqdm)
        results = []
        for rid in ids:
            out = final[rid]
            results.append(BeamSearchOutput([BeamSearchSequence(
                tokens=out.prompt_token_ids + c.token_ids, cum_logprob=c.cumulative_logprob,
                text=c.text, finish_reason=c.finish_reason) for c in out.outputs]))
        return results

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        final: dict[str, RequestOutput] = {}
        completions: dict[str, dict[int, CompletionOutput]] = {i: {} for i in ids}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            so = self.engine.schedule()
            ro = self.executor.execute_model(so)
            for out in self.engine.process_output(so, ro):
                for c in out.outputs:
                    completions[out.request_id][c.index] = c
                if out.finished:
                    out.outputs = [completions[out.request_id][k]
                                   for k in sorted(completions[out.request_id])]
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return final

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (the next requests run cold)."""
        return self.engine.reset_prefix_cache()

    def stats(self):
        return self.engine.stats()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
