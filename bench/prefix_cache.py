"""Prefix caching: time to first token with a cached system prompt, and the
hit rate of a multi-turn chat replay.

1. TTFT. A request = a ~1,500-token system prompt (a made-up company
   handbook) + a short user question, through the model's chat template,
   ``max_tokens=1``. Measured in one process, on one engine, alternating:
   cold (``reset_prefix_cache()`` first: the whole prompt is prefilled) and
   cached (another question with the same system prompt ran first, so only
   the question, the template's tail and the system prompt's last partial
   block are computed). TTFT is from ``add_request`` to the step that
   returns the first token, stepping ``EngineCore`` by hand (no HTTP, no
   tokenizer: the engine's own share). Target on the 2-core dev machine:
   cached TTFT <= 15% of cold.
2. Chat replay. A few conversations run side by side, turn by turn; each turn
   resends the whole history (system prompt, earlier questions and the
   model's own answers) through the chat template, as a chat client does.
   Per turn: prompt tokens, tokens served from the prefix cache (the
   engine's ``num_cached_tokens``), the hit rate, and the best possible
   rate (the prompt's prefix shared with the previous turn's prompt +
   answer, or with another conversation's system prompt, in whole blocks).

Usage:
    python bench/prefix_cache.py                  # 5 TTFT pairs, 3 x 4 chat turns, fp32
    python bench/prefix_cache.py --reps 3 --dtype bfloat16
Prints a table; writes bench/results/prefix_cache.json and
bench/results/prefix_cache.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aioengine import LLM, SamplingParams

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TARGET_RATIO = 0.15

DEPARTMENTS = ["billing", "shipping", "returns", "warranty", "accounts", "support"]
CITIES = ["Lisbon", "Osaka", "Denver", "Nairobi", "Tallinn", "Perth", "Quito", "Leeds"]
QUESTIONS = [
    "Where do orders of 75 units ship from?",
    "How many days do I have to return a damaged item?",
    "Who handles billing disputes, and how fast do they answer?",
    "Can I change the delivery address after an order has shipped?",
    "What does the warranty cover for refurbished devices?",
    "Which office answers support tickets on weekends?",
    "Is there a fee for closing an account?",
]
CONVERSATIONS = [
    ["Hi! I want to return a blender I bought last week.",
     "It arrived with a cracked jug. Do I need the original box?",
     "Okay. How long until I get my money back?",
     "Thanks. Can you summarize what I need to do?"],
    ["What is the capital of Portugal?",
     "What is it famous for?",
     "Suggest a one-day walking route there.",
     "Which of those places is best at sunset?"],
    ["Write a haiku about autumn rain.",
     "Now make it about winter instead.",
     "Explain the rules of a haiku in two sentences.",
     "Write one more, about the sea."],
]
CHAT_SYSTEM = "You are a friendly assistant. Keep answers short."


def handbook(tokenizer, min_tokens: int) -> str:
    """A made-up support handbook of at least ``min_tokens`` tokens."""
    sentences, i = [], 0
    while True:
        dept, city = DEPARTMENTS[i % len(DEPARTMENTS)], CITIES[i % len(CITIES)]
        sentences.append(
            f"Section {i + 1}. The {dept} team in {city} answers tickets about orders "
            f"above {25 * (i + 1)} units within {i % 4 + 1} business days; escalations go "
            f"to the {DEPARTMENTS[(i + 2) % len(DEPARTMENTS)]} lead, and customers get a "
            f"written reply that quotes policy {100 + 7 * i}.")
        text = "You are the support assistant of Northwind Supplies. " + " ".join(sentences)
        if len(tokenizer.encode(text)) >= min_tokens:
            return text
        i += 1


def chat_ids(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    return llm.tokenizer.encode(text, add_special_tokens=False)


class Runner:
    """Drives one in-process engine by hand and times its steps."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.counter = 0

    def run(self, prompts: list[list[int]], params: SamplingParams,
            salt: str | None = None) -> list[dict]:
        """Run the prompts together. Per prompt: TTFT (s), cached tokens,
        output token ids."""
        engine = self.llm.engine
        ids, t_first = [], {}
        t0 = time.perf_counter()
        for token_ids in prompts:
            self.counter += 1
            ids.append(f"bench-{self.counter}")
            engine.add_request(ids[-1], token_ids, params, cache_salt=salt)
        done: dict[str, dict] = {}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            so = engine.schedule()
            ro = self.llm.executor.execute_model(so)
            now = time.perf_counter()
            for out in engine.process_output(so, ro):
                t_first.setdefault(out.request_id, now - t0)
                tokens[out.request_id] += out.outputs[0].delta_token_ids
                if out.finished:
                    done[out.request_id] = {"ttft_s": t_first[out.request_id],
                                            "cached_tokens": out.num_cached_tokens,
                                            "token_ids": tokens[out.request_id]}
        return [done[i] for i in ids]


def bench_ttft(runner: Runner, system: str, reps: int) -> dict:
    llm = runner.llm
    kv = llm.engine.kv_cache_manager
    first_token = SamplingParams(temperature=0, max_tokens=1)
    prompts = [chat_ids(llm, [{"role": "system", "content": system},
                              {"role": "user", "content": q}]) for q in QUESTIONS]
    cold, cached, cached_tokens, loads = [], [], [], []
    for rep in tqdm(range(reps), desc="TTFT cold/cached"):
        loads.append(os.getloadavg()[0])
        target = prompts[rep % len(prompts)]
        primer = prompts[(rep + 1) % len(prompts)]
        assert kv.reset_prefix_cache()
        (c,) = runner.run([target], first_token)
        assert c["cached_tokens"] == 0
        cold.append(c["ttft_s"])
        assert kv.reset_prefix_cache()
        runner.run([primer], first_token)  # caches the system prompt
        (w,) = runner.run([target], first_token)
        cached.append(w["ttft_s"])
        cached_tokens.append(w["cached_tokens"])
    med_cold, med_cached = statistics.median(cold), statistics.median(cached)
    # Other people's jobs share the machine: each pair ran back to back, so
    # its own ratio is the figure least disturbed by load that drifts.
    pair_ratios = [w / c for w, c in zip(cached, cold)]
    return {"prompt_tokens": [len(p) for p in prompts[:reps]],
            "system_prompt_tokens": len(llm.tokenizer.encode(system)),
            "cold_ttft_s": cold, "cached_ttft_s": cached, "cached_tokens": cached_tokens,
            "loadavg_1m_per_pair": loads, "pair_ratios": pair_ratios,
            "median_pair_ratio": statistics.median(pair_ratios),
            "median_cold_ttft_s": med_cold, "median_cached_ttft_s": med_cached,
            "cached_over_cold": med_cached / med_cold,
            "target_cached_over_cold": TARGET_RATIO,
            "meets_target": med_cached / med_cold <= TARGET_RATIO}


def common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def bench_chat(runner: Runner, max_tokens: int, block_size: int) -> dict:
    """Conversations side by side, each turn resending the whole history."""
    llm = runner.llm
    assert llm.engine.kv_cache_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    histories = [[{"role": "system", "content": CHAT_SYSTEM}] for _ in CONVERSATIONS]
    previous: list[list[int]] = [[] for _ in CONVERSATIONS]  # last prompt + answer
    stats0 = llm.stats()
    turns = []
    num_turns = len(CONVERSATIONS[0])
    for turn in tqdm(range(num_turns), desc="chat replay turns"):
        prompts = []
        for history, conv in zip(histories, CONVERSATIONS):
            history.append({"role": "user", "content": conv[turn]})
            prompts.append(chat_ids(llm, history))
        outs = runner.run(prompts, params)
        best = 0
        for k, (prompt, out) in enumerate(zip(prompts, outs)):
            reusable = max([common_prefix_len(prompt, previous[k])]
                           + [common_prefix_len(prompt, p) for p in prompts[:k]])
            best += min(reusable // block_size, (len(prompt) - 1) // block_size) * block_size
            previous[k] = prompt + out["token_ids"][:-1]  # the last token is never computed
            histories[k].append({"role": "assistant",
                                 "content": llm.tokenizer.decode(out["token_ids"],
                                                                 skip_special_tokens=True)})
        num_prompt = sum(len(p) for p in prompts)
        num_cached = sum(o["cached_tokens"] for o in outs)
        turns.append({"turn": turn + 1, "prompt_tokens": num_prompt, "cached_tokens": num_cached,
                      "hit_rate": num_cached / num_prompt, "best_hit_rate": best / num_prompt,
                      "mean_ttft_s": statistics.mean(o["ttft_s"] for o in outs)})
    stats1 = llm.stats()
    queries = stats1.prefix_cache_queries - stats0.prefix_cache_queries
    hits = stats1.prefix_cache_hits - stats0.prefix_cache_hits
    return {"conversations": len(CONVERSATIONS), "turns": turns,
            "engine_prefix_cache_queries": queries, "engine_prefix_cache_hits": hits,
            "hit_rate": hits / queries}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttft, chat = report["ttft"], report["chat"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    medians = [ttft["median_cold_ttft_s"] * 1e3, ttft["median_cached_ttft_s"] * 1e3]
    ax1.bar(["cold", "cached"], medians, color=["#b0b0b0", "#2a7ab9"])
    for x, values in enumerate([ttft["cold_ttft_s"], ttft["cached_ttft_s"]]):
        ax1.scatter([x] * len(values), [v * 1e3 for v in values], color="black", s=10, zorder=3)
    for x, m in enumerate(medians):
        ax1.annotate(f"{m:,.0f} ms", (x, m), xytext=(0, 4), textcoords="offset points",
                     ha="center", va="bottom")
    ax1.set_ylabel("time to first token (ms; bars: median, dots: each run)")
    ax1.set_title(f"{ttft['system_prompt_tokens']}-token system prompt: cached = "
                  f"{100 * ttft['cached_over_cold']:.1f}% of cold", fontsize=10)
    turns = [t["turn"] for t in chat["turns"]]
    ax2.bar(turns, [100 * t["hit_rate"] for t in chat["turns"]], color="#2a7ab9",
            label="hit rate")
    ax2.plot(turns, [100 * t["best_hit_rate"] for t in chat["turns"]], "k_", markersize=25,
             label="reusable prefix (whole blocks)")
    ax2.set_xticks(turns)
    ax2.set_ylim(0, 100)
    ax2.set_xlabel("turn")
    ax2.set_ylabel("prompt tokens from the prefix cache (%)")
    ax2.set_title(f"chat replay, {chat['conversations']} conversations: "
                  f"{100 * chat['hit_rate']:.1f}% overall", fontsize=10)
    ax2.legend(loc="upper left", fontsize=8)
    cfg = report["config"]
    fig.suptitle(f"aioengine prefix caching, SmolLM2-135M {cfg['dtype']}, "
                 f"{cfg['threads']} threads, load {report['loadavg_start'][0]:.1f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="cold/cached TTFT pairs")
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--chat-max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--output-json", default=str(RESULTS_DIR / "prefix_cache.json"))
    parser.add_argument("--output-png", default=str(RESULTS_DIR / "prefix_cache.png"))
    args = parser.parse_args()

    import torch

    load_start = list(os.getloadavg())
    llm = LLM(executor="inproc", dtype=args.dtype, num_threads=args.threads)
    runner = Runner(llm)
    system = handbook(llm.tokenizer, args.system_tokens)
    runner.run([chat_ids(llm, [{"role": "user", "content": "Hello!"}])],
               SamplingParams(temperature=0, max_tokens=2))  # warm-up
    ttft = bench_ttft(runner, system, args.reps)
    chat = bench_chat(runner, args.chat_max_tokens, llm.config.cache.block_size)
    llm.shutdown()

    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": {"dtype": args.dtype, "threads": torch.get_num_threads(),
                   "block_size": llm.config.cache.block_size, "reps": args.reps},
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M:%S")},
        "loadavg_start": load_start, "loadavg_end": list(os.getloadavg()),
        "ttft": ttft, "chat": chat,
    }
    print(f"\nTTFT, {ttft['system_prompt_tokens']}-token system prompt + question "
          f"({min(ttft['prompt_tokens'])}-{max(ttft['prompt_tokens'])} prompt tokens), "
          f"median of {args.reps}:")
    print(f"  {'cold':<8}{ttft['median_cold_ttft_s'] * 1e3:>10,.0f} ms")
    print(f"  {'cached':<8}{ttft['median_cached_ttft_s'] * 1e3:>10,.0f} ms   "
          f"({statistics.median(ttft['cached_tokens']):.0f} tokens from the cache)")
    print(f"  cached / cold = {100 * ttft['cached_over_cold']:.1f}% of the medians, "
          f"{100 * ttft['median_pair_ratio']:.1f}% median of pairs  "
          f"(target <= {100 * TARGET_RATIO:.0f}%: {'met' if ttft['meets_target'] else 'MISSED'})")
    print(f"  load average during the pairs: "
          f"{min(ttft['loadavg_1m_per_pair']):.1f}-{max(ttft['loadavg_1m_per_pair']):.1f}")
    print(f"\nChat replay, {chat['conversations']} conversations side by side:")
    print(f"  {'turn':>4} {'prompt tok':>11} {'cached tok':>11} {'hit rate':>9} "
          f"{'best':>6} {'mean TTFT':>10}")
    for t in chat["turns"]:
        print(f"  {t['turn']:>4} {t['prompt_tokens']:>11,} {t['cached_tokens']:>11,} "
              f"{100 * t['hit_rate']:>8.1f}% {100 * t['best_hit_rate']:>5.1f}% "
              f"{t['mean_ttft_s'] * 1e3:>8,.0f} ms")
    print(f"  overall (engine counters): {100 * chat['hit_rate']:.1f}% of "
          f"{chat['engine_prefix_cache_queries']:,} prompt tokens")
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    plot(report, Path(args.output_png))
    print(f"\nwrote {args.output_json} and {args.output_png}")


if __name__ == "__main__":
    main()
