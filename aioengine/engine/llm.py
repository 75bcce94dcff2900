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
from aioengine.engine.core import EngineStats
from aioengine.engine.llm_engine import LLMEngine
from aioengine.executor import make_executor
from aioengine.models.loader import inspect_model
from aioengine.sampling_params import CompletionOutput, RequestOutput, SamplingParams
from aioengine.tokenizer import load_tokenizer


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
        if self.config.parallel.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 is for the server (aioengine serve "
                "--data-parallel-size N); LLM runs one engine"
            )
        m = self.config.model
        self.model_info = inspect_model(m.model_path, m.quantization, m.dtype)
        self.tokenizer = load_tokenizer(m.model_path)
        self.executor = make_executor(self.config)
        self.engine = LLMEngine(self.config, self.tokenizer, self.executor)
        self._counter = 0

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Args:
            prompts: a string or a token-id list, or a sequence of them.
            sampling_params: one for all prompts or one per prompt.
            priority: per prompt, lower first.
        """
        prompt_list: list[str | list[int]]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompt_list)
        if len(params_list) != len(prompt_list):
            raise ValueError("need one SamplingParams per prompt")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompt_list, params_list)):
            token_ids = (
                self.engine.input_processor.tokenize(prompt)
                if isinstance(prompt, str)
                else [int(t) for t in prompt]
            )
            request_id = str(self._counter)
            self._counter += 1
            self.add_request(request_id, token_ids, p, priority=priority[i] if priority else 0)
            ids.append(request_id)
        final = self.run_until_finished(use_tqdm)
        return [final[i] for i in ids]

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Queue one request for the next ``run_until_finished``.

        Raises:
            GrammarError: a structured-output constraint that does not compile
                (before anything is queued).
            RequestRejected, SamplingParamError, SchedulerQueueFull, ValueError:
                see ``LLMEngine.add_request``.
        """
        if params.structured_outputs is not None:
            self.engine.structured_output_manager.compile_sync(params.structured_outputs)
        self.engine.add_request(
            request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt
        )

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        token_ids: list[str | list[int]] = [
            self.engine.input_processor.render_chat(c)  # type: ignore[arg-type]
            for c in convs
        ]
        return self.generate(token_ids, sampling_params, use_tqdm)

    def beam_search(
        self,
        prompts: str | list[int] | dict | Sequence[str | list[int] | dict],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt, as vLLM's ``LLM.beam_search``; the prompts run
        together, each one's beams sharing KV blocks copy-on-write.

        Args:
            prompts: strings, token-id lists, or vLLM prompt dicts (``{"prompt": ...}``
                or ``{"prompt_token_ids": [...]}``), one or a sequence of them.
            params: beam width, max_tokens, length_penalty, early_stopping ...

        Returns:
            Per prompt, in order, ``sequences``: the ``beam_width`` best beams, best
            first, each with ``tokens`` (prompt and output), ``text`` (the output, EOS
            left out), ``cum_logprob`` and ``finish_reason``.

        Raises:
            RequestRejected: a prompt that can never run (too long for the context).
        """
        prompt_list: list
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [prompts]
        else:
            prompt_list = list(prompts)
        ids = []
        for prompt in prompt_list:
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids") or prompt["prompt"]
            token_ids = (
                self.engine.input_processor.tokenize(prompt)
                if isinstance(prompt, str)
                else [int(t) for t in prompt]
            )
            request_id = str(self._counter)
            self._counter += 1
            self.engine.add_beam_search_request(request_id, token_ids, params)
            ids.append(request_id)
        final = self.run_until_finished(use_tqdm)
        results = []
        for rid in ids:
            out = final[rid]
            results.append(
                BeamSearchOutput(
                    [
                        BeamSearchSequence(
                            tokens=out.prompt_token_ids + c.token_ids,
                            cum_logprob=c.cumulative_logprob or 0.0,
                            text=c.text,
                            finish_reason=c.finish_reason,
                        )
                        for c in out.outputs
                    ]
                )
            )
        return results

    def run_until_finished(self, use_tqdm: bool = False) -> dict[str, RequestOutput]:
        """Step until every queued request has finished; the final
        ``RequestOutput`` of each, by request id, with all its samples."""
        final: dict[str, RequestOutput] = {}
        samples: dict[str, dict[int, CompletionOutput]] = {}
        bar = tqdm(
            total=len(self.engine.output_processor.parents), desc="generate", disable=not use_tqdm
        )
        while self.engine.has_unfinished_requests():
            for out in self.engine.step().request_outputs:
                by_index = samples.setdefault(out.request_id, {})
                by_index.update((c.index, c) for c in out.outputs)
                if out.finished:
                    out.outputs = [by_index[k] for k in sorted(by_index)]
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return final

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (the next requests run cold)."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
