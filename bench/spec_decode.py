"""Speculative decoding (n-gram or a draft model) against no speculation, same run, same machine.

Workloads (greedy, the model's own EOS or ``--max-tokens``):

- input-grounded, batch 1: edit a given ~500-token text (fix its typos and
  return it whole), repeat a code block with one change; also "summarise
  the text" reported on its own line;
- open-ended chat, batch 1: chat prompts with nothing to copy (low acceptance);
- 16 concurrent streams: the chat prompts and the grounded ones together.

Each batch-1 prompt runs ``--repeats`` times per engine, the two engines
alternating (off/on, then on/off) so a load change on the shared machine hits
both; a workload's tokens/s is its total tokens over its total time. Both
engines load the default model in this process (``executor="inproc"``).
Greedy outputs are compared token for token and the report says whether
they matched. Prints the CPU model and SIMD flags; writes JSON and a PNG.

    python bench/spec_decode.py                  # full run (~10 min on 2 cores)
    python bench/spec_decode.py --quick          # a smoke run
    python bench/spec_decode.py --method draft_model   # the default model drafts for itself

``--method draft_model`` proposes with ``--draft-model`` (default: the default
model's own GGUF, since no smaller model with SmolLM2's tokenizer is installed
here). A model drafting for itself is an upper bound on acceptance (every
greedy draft is accepted) and a worst case on draft cost (a draft step costs
a target step): tokens/s is then at most ``(k + 1)`` tokens per ``k`` draft
decodes plus one verification, below 1x; it measures the machinery's
overhead at perfect acceptance, not the gain of a real small draft. With a
draft costing a fraction ``c`` of the target and acceptance ``a`` per token,
a step yields ``(1 - a^(k+1)) / (1 - a)`` tokens for about ``k c + v`` target
steps (``v``: the verification's cost relative to a decode).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

# As the worker process sets it (aioengine/worker/worker.py): both engines run in
# this process, and the shared machine has more busy processes than cores.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CHAT_PROMPTS, RESULTS_DIR, LoadTracker, environment, write_results  # noqa: E402
from bench.quantized import cpu_info  # noqa: E402

TEXT = """The town of Eldermere sits at the northern end of a long glacial lake, \
where the river Oss leaves the water and turns east toward the coast. For most of its history \
it was a market town: farmers from the valleys brought wool, cheese and timber down to the \
quay, and barges carried them along the river to the port of Calder, two days away. The old \
market hall, built in 1742 from grey lake stone, still stands in the square, although the \
stalls inside now sell coffee, books and pottery rather than fleeces.

The arrival of the railway in 1868 changed the town more than any event before it. The line \
followed the eastern shore of the lake, and the station was built on reclaimed marsh south of \
the square. Within twenty years the population had doubled. Visitors from the cities came \
for the clean air and the views of the fells, and a row of hotels went up along the lake \
front. The largest of them, the Grand Lakeside, had ninety rooms, a ballroom and its own \
steamer pier, from which boats left every hour in summer for the villages on the far shore.

Industry followed the visitors. A pencil factory opened in 1881, using graphite mined in the \
hills to the west, and for almost a century it was the largest employer in the district. At \
its peak it made more than a million pencils a week. The factory closed in 1979, and its \
buildings were turned into a museum, a brewery and a set of small workshops for local \
craftspeople.

Today about eight thousand people live in Eldermere. Tourism remains the main source of \
income, but the town has also become known for its annual festival of walking, held every \
May, when several thousand people arrive to follow marked routes across the surrounding \
hills. The festival was started in 1994 by a group of volunteers from the mountain rescue \
team, who wanted to raise money for new equipment. It now supports a dozen local charities.

The lake itself is owned by a trust, which controls fishing, boating and building along the \
shore. Motor boats are limited to a speed of ten knots, and no new buildings have been \
allowed within fifty metres of the water since 1951. As a result, much of the shoreline is \
still woodland and open meadow, and the lake is one of the few in the region where otters \
have returned in numbers."""

# The text with a handful of typos for the edit task.
TYPOS = [("glacial", "glacail"), ("farmers", "farmars"), ("population", "popluation"),
         ("factory opened", "factory opned"), ("volunteers", "volunters"),
         ("woodland", "woodlnad")]

CODE = '''def parse_config(path):
    """Read a key = value file into a dict, skipping comments and blank lines."""
    config = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError(f"{path}:{number}: expected key = value")
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config


def merge_configs(base, override):
    """A new dict with the keys of base, replaced or extended by override."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged


def load_all(paths):
    """Merge the config files in order; later files win."""
    result = {}
    for path in paths:
        result = merge_configs(result, parse_config(path))
    return result
'''


def edit_text() -> str:
    text = TEXT
    for right, wrong in TYPOS:
        text = text.replace(right, wrong, 1)
    return text


def grounded_prompts() -> dict[str, str]:
    return {
        "edit_text": ("Correct the spelling mistakes in the following text. Reply with the whole "
                      "corrected text and nothing else.\n\n" + edit_text()),
        "code_change": ("Repeat the following Python code exactly, with one change: rename the "
                        "function parse_config to read_config everywhere. Reply with the code "
                        "only.\n\n" + CODE),
    }


def summarise_prompt() -> str:
    return "Summarise the following text in a few paragraphs.\n\n" + TEXT


def chat_ids(tokenizer, text: str) -> list[int]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


_ids = itertools.count()


def run_one(llm, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """One greedy request alone: ``(tokens, seconds, seconds to the first token)``."""
    from aioengine import SamplingParams

    engine = llm.engine
    request_id = f"bench-{next(_ids)}"
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt_ids, SamplingParams(temperature=0,
                                                              max_tokens=max_tokens))
    first, tokens = None, []
    while engine.has_unfinished_requests():
        so = engine.schedule()
        for out in engine.process_output(so, llm.executor.execute_model(so)):
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
            tokens = out.outputs[0].token_ids
    return tokens, time.perf_counter() - t0, first or 0.0


def batch1(engines: dict, prompts: dict[str, list[int]], max_tokens: int, repeats: int,
           load: LoadTracker) -> dict:
    """Per prompt and engine: tokens, seconds; engines alternate per repeat."""
    rows = {}
    for name, ids in prompts.items():
        per = {w: {"tokens": 0, "seconds": 0.0, "decode_tokens": 0, "decode_seconds": 0.0,
                   "runs": []} for w in ("off", "on")}
        outputs = {}
        for r in range(repeats):
            order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
            for which in order:
                tokens, dt, ttft = run_one(engines[which], ids, max_tokens)
                per[which]["tokens"] += len(tokens)
                per[which]["seconds"] += dt
                per[which]["decode_tokens"] += len(tokens) - 1
                per[which]["decode_seconds"] += dt - ttft
                per[which]["runs"].append(round(len(tokens) / dt, 2))
                outputs[which] = tokens
        for which in per:
            per[which]["tok_per_s"] = per[which]["tokens"] / per[which]["seconds"]
            per[which]["decode_tok_per_s"] = (per[which]["decode_tokens"]
                                              / per[which]["decode_seconds"])
        rows[name] = {**per, "prompt_tokens": len(ids), "output_tokens": len(outputs["off"]),
                      "greedy_equal": outputs["off"] == outputs["on"],
                      "speedup": per["on"]["tok_per_s"] / per["off"]["tok_per_s"],
                      "decode_speedup": (per["on"]["decode_tok_per_s"]
                                         / per["off"]["decode_tok_per_s"])}
        load.sample()
        print(f"  {name:14s} prompt {len(ids):4d} out {len(outputs['off']):4d}  "
              f"off {per['off']['tok_per_s']:6.1f} tok/s  on {per['on']['tok_per_s']:6.1f} "
              f"tok/s  x{rows[name]['speedup']:.2f} "
              f"(decode only x{rows[name]['decode_speedup']:.2f})  "
              f"equal={rows[name]['greedy_equal']}",
              flush=True)
    return rows


def aggregate(rows: dict) -> dict:
    out = {}
    for which in ("off", "on"):
        tokens = sum(r[which]["tokens"] for r in rows.values())
        seconds = sum(r[which]["seconds"] for r in rows.values())
        out[which] = tokens / seconds
        out[f"{which}_decode"] = (sum(r[which]["decode_tokens"] for r in rows.values())
                                  / sum(r[which]["decode_seconds"] for r in rows.values()))
    out["speedup"] = out["on"] / out["off"]
    out["decode_speedup"] = out["on_decode"] / out["off_decode"]
    return out


def concurrent(engines: dict, prompts: list[list[int]], max_tokens: list[int], repeats: int,
               load: LoadTracker) -> dict:
    """All ``prompts`` at once, request ``i`` generating ``max_tokens[i]`` tokens
    (EOS ignored), ``repeats`` pairs of runs, off/on then on/off. Reports the
    totals' ratio and the median of the pairs' ratios (a load change on the
    shared machine moves one pair, not the median), and, for the "on" engine,
    the steps by running requests and the draft tokens it verified, so a loss
    can be told from noise."""
    from aioengine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    res = {"off": [0, 0.0], "on": [0, 0.0]}
    pairs: list[float] = []
    before = engines["on"].stats()
    steps_before = before.num_steps
    for r in range(repeats):
        rate = {}
        for which in (["off", "on"] if r % 2 == 0 else ["on", "off"]):
            t0 = time.perf_counter()
            outs = engines[which].generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            res[which][0] += n
            res[which][1] += dt
            rate[which] = n / dt
        pairs.append(rate["on"] / rate["off"])
        load.sample()
    after = engines["on"].stats()
    out: dict = {w: res[w][0] / res[w][1] for w in res}
    out["speedup"] = out["on"] / out["off"]
    out["pair_speedups"] = [round(x, 3) for x in pairs]
    out["median_pair_speedup"] = statistics.median(pairs)
    out["streams"] = len(prompts)
    out["max_tokens"] = sorted(set(max_tokens))
    out["on_steps"] = after.num_steps - steps_before
    out["on_draft_tokens"] = (after.spec_decode_num_draft_tokens
                              - before.spec_decode_num_draft_tokens)
    out["on_accepted_tokens"] = (after.spec_decode_num_accepted_tokens
                                 - before.spec_decode_num_accepted_tokens)
    print(f"  off {out['off']:6.1f} tok/s  on {out['on']:6.1f} tok/s  x{out['speedup']:.2f} "
          f"(pairs {out['pair_speedups']}, median x{out['median_pair_speedup']:.2f}); on: "
          f"{out['on_draft_tokens']} draft tokens verified, {out['on_accepted_tokens']} "
          f"accepted, in {out['on_steps']} steps", flush=True)
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    from aioengine.spec_decode.config import DEFAULT_VERIFY_TOKEN_COST

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, off, on = [], [], []
    for name, row in report["grounded"].items():
        labels.append(name)
        off.append(row["off"]["tok_per_s"])
        on.append(row["on"]["tok_per_s"])
    for row in report["summarise"].values():
        labels.append("summarise")
        off.append(row["off"]["tok_per_s"])
        on.append(row["on"]["tok_per_s"])
    agg = report["open_chat_total"]
    labels.append("open chat")
    off.append(agg["off"])
    on.append(agg["on"])
    for key, name in (("concurrent", "streams"), ("concurrent_ragged", "streams,\nragged")):
        c = report[key]
        labels.append(f"{c['streams']} {name}")
        off.append(c["off"])
        on.append(c["on"])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], off, 0.4, label="no speculation")
    config = report["config"]
    method = config.get("method", "ngram")
    cost = config["speculative_config"].get("verify_token_cost", DEFAULT_VERIFY_TOKEN_COST)
    if method == "ngram":
        label = f"n-gram, k<={config['k']}, verify_token_cost {cost}"
    else:
        label = (f"draft model {Path(config['speculative_config']['model']).name}, "
                 f"k<={config['k']}, verify_token_cost {cost}")
    ax.bar([i + 0.2 for i in x], on, 0.4, label=label)
    for i, (a, b) in enumerate(zip(off, on)):
        ax.text(i + 0.2, b, f"x{b / a:.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("generated tokens / s")
    cpu = report["cpu"]["model"]
    load = report.get("load", {})
    busy = (f", 1-min load {load['loadavg_1m_min']:.1f}-{load['loadavg_1m_max']:.1f}"
            if "loadavg_1m_min" in load else "")
    ax.set_title(f"Speculative decoding, SmolLM2-135M Q4_1, greedy\n{cpu} "
                 f"({report['cpu']['cpus']} cpus{busy})", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=7,
                    help="num_speculative_tokens, the most drafts per request and step; the "
                         "dynamic rule picks each step's (7: copied spans often run that far, "
                         "and 8 rows are two passes of the quantized GEMV's 4-row tiles)")
    ap.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    ap.add_argument("--draft-model", default=None,
                    help="draft model path for --method draft_model (default: the default "
                         "model's own GGUF: an upper bound on acceptance, see above)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="no drafts while this many requests run (default: the config's, 8; "
                         "0 never)")
    ap.add_argument("--verify-token-cost", type=float, default=None,
                    help="the dynamic rule's cost of a query token, in decode steps "
                         "(default: the config's, 0.25; 0 verifies every proposal)")
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--concurrent-repeats", type=int, default=4,
                    help="off/on pairs of the concurrent workloads (their ratio's median is "
                         "reported with the totals')")
    ap.add_argument("--quick", action="store_true", help="short outputs, one repeat")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/)")
    ap.add_argument("--plot", default=str(RESULTS_DIR / "spec_decode.png"))
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.repeats, args.concurrent_repeats = 24, 1, 1

    from aioengine import LLM

    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  ({cpu['cpus']} cpus; {' '.join(cpu['simd_flags'])})")
    load = LoadTracker()
    load.sample()
    if args.method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k,
                "prompt_lookup_min": args.prompt_lookup_min,
                "prompt_lookup_max": args.prompt_lookup_max}
    else:
        from aioengine.config import default_model_path

        spec = {"method": "draft_model", "num_speculative_tokens": args.k,
                "model": args.draft_model or default_model_path()}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    if args.verify_token_cost is not None:
        spec["verify_token_cost"] = args.verify_token_cost
    engines = {"off": LLM(executor="inproc"), "on": LLM(executor="inproc",
                                                         speculative_config=spec)}
    tok = engines["off"].tokenizer
    for llm in engines.values():  # warm-up: kernels, allocator
        run_one(llm, chat_ids(tok, "Hello!"), 8)
    print(f"speculative_config {spec}")
    print("input-grounded, batch 1:")
    grounded = batch1(engines, {k: chat_ids(tok, v) for k, v in grounded_prompts().items()},
                      args.max_tokens, args.repeats, load)
    print("summarise, batch 1:")
    summarise = batch1(engines, {"summarise": chat_ids(tok, summarise_prompt())},
                       args.max_tokens, args.repeats, load)
    chats = CHAT_PROMPTS[:4] if not args.quick else CHAT_PROMPTS[:1]
    print("open-ended chat, batch 1:")
    open_chat = batch1(engines, {f"chat{i}": chat_ids(tok, t) for i, t in enumerate(chats)},
                       min(args.max_tokens, 200), args.repeats, load)
    streams = [chat_ids(tok, t) for t in CHAT_PROMPTS[:14]] + [
        chat_ids(tok, v) for v in grounded_prompts().values()]
    if args.quick:
        streams = streams[:4]
    longest = min(args.max_tokens, 128)
    print(f"{len(streams)} concurrent streams, {longest} tokens each:")
    conc = concurrent(engines, streams, [longest] * len(streams), args.concurrent_repeats,
                      load)
    # Ragged lengths: the batch shrinks from 16 to 1 as streams finish, so most of
    # the run is below disable_by_batch_size (the ramp-down a real server sees).
    ragged = [max(8, longest * (i + 1) // len(streams)) for i in range(len(streams))]
    print(f"{len(streams)} concurrent streams, {ragged[0]} to {ragged[-1]} tokens:")
    conc_ragged = concurrent(engines, streams, ragged, args.concurrent_repeats, load)
    load.sample()
    report = {
        "cpu": cpu, "environment": environment(0, "float32"), "load": load.summary(),
        "config": {"method": args.method, "speculative_config": spec, "k": args.k,
                   "prompt_lookup_min": args.prompt_lookup_min,
                   "prompt_lookup_max": args.prompt_lookup_max, "max_tokens": args.max_tokens,
                   "repeats": args.repeats},
        "grounded": grounded, "grounded_total": aggregate(grounded),
        "summarise": summarise, "open_chat": open_chat, "open_chat_total": aggregate(open_chat),
        "concurrent": conc, "concurrent_ragged": conc_ragged,
        "spec_stats": {k: v for k, v in vars(engines["on"].stats()).items()
                       if k.startswith("spec_decode")},
    }
    g, o = report["grounded_total"], report["open_chat_total"]
    print(f"input-grounded total: off {g['off']:.1f} tok/s, on {g['on']:.1f} tok/s, "
          f"x{g['speedup']:.2f}, decode only x{g['decode_speedup']:.2f} (target >= 1.6)")
    print(f"open-ended chat total: off {o['off']:.1f} tok/s, on {o['on']:.1f} tok/s, "
          f"x{o['speedup']:.2f}, decode only x{o['decode_speedup']:.2f} (target >= 0.95)")
    for name, c in (("", conc), (" ragged", conc_ragged)):
        print(f"{c['streams']} streams{name}: off {c['off']:.1f} tok/s, on {c['on']:.1f} tok/s, "
              f"x{c['speedup']:.2f}, median of pairs x{c['median_pair_speedup']:.2f} "
              f"(target >= 1.0)")
    print("spec_decode:", report["spec_stats"])
    print("load:", load.summary()["loadavg_1m_min"], "-", load.summary()["loadavg_1m_max"])
    path = write_results(args.out, "spec_decode.json", report)
    print(f"wrote {path}")
    if args.plot:
        plot(report, Path(args.plot))
        print(f"wrote {args.plot}")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
