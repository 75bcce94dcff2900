"""The benchmark scripts run on a tiny workload and write their JSON.

Speed is never asserted: these pin down that bench/throughput.py,
bench/serving.py and bench/scheduler.py run end to end (engine and HF sides,
SSE and WebSocket) and report the keys the README's table is built from.
serving.py and scheduler.py reuse the session's test server (``--url``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # bench/ is not an installed package

from bench.baseline_hf import hf_static_batch_latency, left_pad  # noqa: E402
from bench.common import (  # noqa: E402
    BenchRequest,
    chat_workload,
    latency_summary,
    percentile,
    synthetic_workload,
)

LATENCY_KEYS = {"count", "mean_ms", "p50_ms", "p90_ms", "p99_ms"}


def run_script(name: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / name), *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


# -- helpers ---------------------------------------------------------------------------------


def test_decode_step_summary_keeps_full_width_decodes_after_the_first() -> None:
    from bench.serving import decode_step_summary

    steps = [[1, 1, 9.0, 0.01],            # warm-up, narrower
             [4, 400, 0.5, 0.2],           # prefill of 4 prompts
             [4, 4, 0.05, 0.020],          # first decode after it: hand-over, dropped
             [4, 4, 0.001, 0.020], [4, 4, 0.003, 0.024],
             [3, 3, 0.5, 0.018],           # a request finished: narrower
             [4, 4, 0.002, 0.022]]         # follows a narrower step: dropped
    out = decode_step_summary(steps)
    assert out is not None and out["num_reqs"] == 4 and out["num_steps"] == 2
    assert out["idle_mean_ms"] == pytest.approx(2.0) and out["idle_p50_ms"] == pytest.approx(2.0)
    assert out["busy_p50_ms"] == pytest.approx(22.0)
    assert out["idle_pct_of_step"] == pytest.approx(100 * 0.004 / 0.048, abs=0.01)
    assert decode_step_summary([[2, 30, 0.1, 0.1]]) is None


def test_percentile_matches_linear_interpolation() -> None:
    values = sorted([5.0, 1.0, 3.0, 2.0, 4.0])
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 90) == pytest.approx(4.6)
    summary = latency_summary([0.001, 0.002, 0.003])
    assert set(summary) == LATENCY_KEYS and summary["p50_ms"] == pytest.approx(2.0)


def test_synthetic_workload_is_seeded_and_in_range() -> None:
    a = synthetic_workload(20, (32, 64), (16, 24), 49152, seed=7)
    b = synthetic_workload(20, (32, 64), (16, 24), 49152, seed=7)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(32 <= r.prompt_len <= 64 and 16 <= r.output_len <= 24 for r in a)
    assert all(100 <= t < 49152 for r in a for t in r.prompt_token_ids)


def test_chat_workload_uses_the_chat_template() -> None:
    from aioengine.config import default_model_path
    from aioengine.models.loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    requests = chat_workload(tokenizer, 3, (8, 8), pad_to_50_tokens=True)
    text = tokenizer.decode(requests[0].prompt_token_ids)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
    assert all(30 <= r.prompt_len <= 90 for r in requests)


def test_left_pad_puts_padding_first() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_hf_static_batch_latency_for_serving_streams_waits_for_the_running_batch() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1)).eval()
    output_lens = [2, 4, 3, 1, 2]
    requests = [BenchRequest([5 + i] * (3 + i), n) for i, n in enumerate(output_lens)]
    timings = hf_static_batch_latency(model, requests, batch_size=2, progress=False)
    assert [len(t.token_times_s) for t in timings] == output_lens
    assert all(t.ttft_s > 0 and t.e2e_s >= t.ttft_s for t in timings)
    assert timings[0].arrival_s == timings[1].arrival_s
    # Client k sends its next request when its previous one has its last
    # token; it waits for the batch still running (request 0 ended first).
    assert timings[2].arrival_s == timings[0].token_times_s[-1]
    assert timings[3].arrival_s == timings[1].token_times_s[-1]
    assert timings[2].token_times_s[0] > timings[1].token_times_s[-1]
    assert timings[2].ttft_s > timings[3].ttft_s
    assert len(timings[1].itl_s) == 3 and timings[3].tpot_s is None


# -- the scripts -------------------------------------------------------------------------------


def test_no_bench_script_shadows_an_installed_module() -> None:
    """``python bench/X.py`` puts bench/ first on sys.path, so a script named like an
    installed module hides it from every import in that run: transformers 5.25 imports
    the ``kernels`` package, and bench/kernels.py broke every bench script that loads HF."""
    bench = Path(__file__).resolve().parents[1] / "bench"
    for script in sorted(bench.glob("*.py")):
        found = importlib.util.find_spec(script.stem)
        assert found is None or Path(found.origin or "").parent == bench, (
            f"bench/{script.name} shadows the installed module {found.origin}")


@pytest.mark.slow
def test_sampling_share_cpu_clock_needs_one_thread() -> None:
    """The CPU clock counts the calling thread only, so with more threads the step
    breakdown would drop the others' work: refused before the model loads."""
    from bench.throughput import sampling_share

    with pytest.raises(ValueError, match="--threads 1"):
        sampling_share([1], 2, 100, 0, clock="cpu")


def test_throughput_script_writes_both_sides(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    run_script("throughput.py", "--num-prompts", "2", "--input-len-range", "8", "16",
               "--output-len-range", "2", "3", "--hf-batch-size", "2", "--batch1-tokens", "3",
               "--overhead-requests", "2", "--overhead-prompt-len", "8",
               "--overhead-output-len", "4", "--ring-round-trips", "50",
               "--sampling-share-rows", "2", "--skip-worker-idle", "--output-json", str(out),
               "--no-progress")
    report = json.loads(out.read_text())
    greedy, sampled = (report["sampling_share"][m] for m in ("greedy_2", "sampled_2"))
    # Plain greedy rows take the LM head's fused argmax: no sampler pass at all.
    assert greedy["sampler_ms"] == 0 and 0 < greedy["lm_head_ms"] < greedy["step_ms"]
    assert 0 < sampled["sampler_ms"] < sampled["step_ms"] and sampled["lm_head_ms"] > 0
    for side in ("engine", "hf"):
        assert {"requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
                "elapsed_s"} <= set(report[side])
    assert set(report["ratio_vs_hf"]) == {"requests_per_s", "output_tokens_per_s",
                                          "total_tokens_per_s"}
    assert report["workload"]["num_requests"] == 2
    b1 = report["batch1_decode"]
    assert "decode_tokens_per_s" in b1["engine"] and "decode_tokens_per_s" in b1["hf"]
    assert "ratio_vs_hf" in b1
    for mode in ("sync", "async"):
        overhead = report["overhead"][mode]
        assert overhead["num_running"] == 2 and overhead["num_steps"] >= 1
        assert {"median_overhead_pct", "median_step_ms", "median_forward_sample_ms"} <= set(
            overhead)
    assert report["ring_round_trip"]["shm_ring"]["median_us"] > 0
    assert report["load"]["samples"]


@pytest.mark.slow
def test_serving_script_against_the_test_server(server, tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    run_script("serving.py", "--url", server.base_url, "--api-key", server.api_key,
               "--scenarios", "chat8,sweep,rate", "--chat-concurrency", "2",
               "--chat-requests", "2", "--chat-max-tokens", "3", "--concurrencies", "1,2",
               "--sweep-min-requests", "2", "--sweep-requests-per-stream", "1",
               "--sweep-input-len", "8", "--sweep-output-len", "3", "--num-requests", "2",
               "--input-len-range", "8", "12", "--output-len-range", "2", "3",
               "--request-rate", "20", "--time-limit", "300", "--hf-with-url",
               "--output-json", str(out), "--plot-dir", str(tmp_path), "--no-progress")
    report = json.loads(out.read_text())
    results = report["results"]
    for protocol in ("sse", "ws"):
        runs = [results["chat8"][protocol], results["rate"][protocol],
                *results["sweep"][protocol]]
        for run in runs:
            assert run["completed"] == run["num_requests"], run["errors"]
            for metric in ("ttft", "tpot", "itl", "e2e"):
                assert set(run[metric]) == LATENCY_KEYS
            assert run["request_throughput"] > 0 and run["output_throughput"] > 0
        assert [r["concurrency"] for r in results["sweep"][protocol]] == [1, 2]
    hf = results["chat8"]["hf"]
    assert hf["batch_size"] == 2 and hf["completed"] == hf["num_requests"] == 2, hf["errors"]
    for metric in ("ttft", "tpot", "itl", "e2e"):
        assert set(hf[metric]) == LATENCY_KEYS
    assert hf["ttft"]["count"] == 2 and hf["ttft"]["p50_ms"] > 0
    assert hf["e2e"]["p50_ms"] >= hf["ttft"]["p50_ms"] and hf["itl"]["count"] == 2 * 2
    assert hf["output_tokens"] == 2 * 3 and hf["output_throughput"] > 0
    for protocol in ("sse", "ws"):
        ratio = results["chat8"]["ratio_vs_hf"][protocol]
        assert ratio["ttft_p50"] > 0 and ratio["output_throughput"] > 0
    assert "api_key" not in report["args"]
    assert (tmp_path / "serving_throughput_vs_concurrency.png").stat().st_size > 0
    assert (tmp_path / "serving_latency_distributions.png").stat().st_size > 0


@pytest.mark.slow
def test_scheduler_script_against_the_test_server(server, tmp_path: Path) -> None:
    out = tmp_path / "scheduler.json"
    run_script("scheduler.py", "--modes", "on", "--url-on", server.base_url,
               "--api-key", server.api_key, "--num-streams", "2", "--stream-prompt-len", "8",
               "--stream-output-len", "4", "--long-prompt-len", "48",
               "--long-prompt-interval", "0.2", "--max-long-prompts", "2",
               "--time-limit", "300", "--output-json", str(out), "--plot-dir", str(tmp_path))
    report = json.loads(out.read_text())
    mode = report["modes"]["on"]
    assert mode["streams_completed"] == 2, mode["stream_errors"]
    assert set(mode["itl_during_long_prompts"]) == LATENCY_KEYS
    assert set(mode["itl_before_long_prompts"]) == LATENCY_KEYS
    assert mode["long_prompts_sent"] >= 1
    assert (tmp_path / "scheduler_itl_chunked_prefill.png").stat().st_size > 0


@pytest.mark.slow
def test_cpu_decode_script_writes_both_paths(tmp_path: Path) -> None:
    from triton_kernels import cpu_ops

    if cpu_ops.load() is None:
        pytest.skip("the C++ CPU kernels did not build here")
    run_script("cpu_decode.py", "--rows", "1,3", "--repeats", "2", "--out", str(tmp_path))
    report = json.loads((tmp_path / "cpu_decode.json").read_text())
    assert [r["rows"] for r in report["matmuls"]] == [1, 3]
    assert all(r["mkl_ms"] > 0 and r["skinny_ms"] > 0 for r in report["matmuls"])
    assert report["step"]["fused_ms"] > 0 and report["step"]["python_ms"] > 0
    assert set(report["cold_op_us"]) == {"after_mul", "after_matmul"}
    assert (tmp_path / "cpu_decode.png").stat().st_size > 0


def test_decode_steps_script_splits_block_boundaries(tmp_path: Path) -> None:
    out = tmp_path / "decode_steps.json"
    run_script("decode_steps.py", "--streams", "3", "--steps", "40", "--output-json", str(out))
    report = json.loads(out.read_text())
    # 40 tokens after a 32-token prompt: positions 32..71 cross blocks at 32, 48 and 64.
    assert report["block_size"] == 16
    assert report["boundary_steps"] == 3 and report["other_steps"] == 39 - 3
    assert report["boundary_ms_p50"] > 0 and report["other_ms_p50"] > 0
    assert report["cpu"]["model"]


def _side(ready_s: float, tok_s: dict[int, float], ttft_ms: dict[int, float],
          batch1: float) -> dict:
    streams = [{"concurrency": c, "output_throughput": t, "ttft": {"p50_ms": ttft_ms[c]},
                "itl": {"p50_ms": 10.0}} for c, t in tok_s.items()]
    return {"batch1": {"decode_tokens_per_s": batch1, "source": "llama-bench, depth 100"},
            "server": {"ready_s": ready_s, "streams": streams,
                       "server_memory": {"rss_mib": 100.0}}}


def test_quantized_ratios_and_table_put_ours_over_llama_cpp() -> None:
    from bench.quantized import ratios, table

    ours = _side(2.0, {1: 60.0, 8: 150.0}, {1: 50.0, 8: 200.0}, 75.0)
    ours["batch1"] = {"decode_tokens_per_s": 75.0}  # LLM's figure names no source
    ours["server"]["worker_memory"] = {"rss_mib": 300.0}
    ours["server"]["restart"] = {"serving_again_s": 1.5}
    theirs = _side(1.0, {1: 50.0, 8: 100.0}, {1: 100.0, 8: 100.0}, 50.0)
    report = {"aioengine": ours, "llama_cpp": theirs, "args": {"threads": 2}, "n_slots": 8}
    report["ratios"] = ratios(report)
    assert report["ratios"]["streams_8"] == {"output_throughput": 1.5, "ttft_p50": 0.5}
    assert report["ratios"]["streams_1"]["ttft_p50"] == 2.0
    assert report["ratios"]["batch1_decode"] == 1.5 and report["ratios"]["ready_s"] == 2.0
    text = table(report)
    assert "| 8 streams: output tok/s (TTFT p50, ITL p50) | 150.0 (TTFT 200 ms" in text
    assert "1.50x tok/s, TTFT 0.50x" in text
    assert "| batch-1 decode tok/s | 75.0 (LLM) | 50.0 (llama-bench, depth 100) | 1.50x |" in text
    assert "worker 300, server 100" in text and "1.50 s" in text
    # The memory roofline row: each side's batch-1 figure over read bandwidth / weight bytes.
    report["roofline"] = {"batch1_roofline_tokens_per_s": 150.0, "read_gbs": 15.0,
                          "decode_weight_mb": 100.0}
    assert "| 50% | 33% |" in table(report)
    # Ours only (no llama-server found): no ratios, llama.cpp's cells say n/a.
    alone = {"aioengine": ours, "args": {"threads": 2}, "n_slots": 8}
    alone["ratios"] = ratios(alone)
    assert alone["ratios"] == {} and "llama.cpp (not run)" in table(alone)


def test_quantized_compute_table_names_the_ceiling_that_applies() -> None:
    from bench.quantized import compute_table, dtype_in_use

    def run(c: int, tok_s: float, gflops: float) -> dict:
        return {"concurrency": c, "output_throughput": tok_s,
                "compute": {"gflops": gflops, "mflop_per_output_token": 445.0,
                            "share": {"fp32": gflops / 400.0, "bf16": gflops / 1600.0}}}

    report = {"roofline": {"fp32_gemm_gflops": 400.0, "bf16_gemm_gflops": 1600.0},
              "gemm_path": "amx-bf16",
              "aioengine": {"server": {"streams": [run(8, 300.0, 120.0), run(32, 600.0, 240.0)]}},
              "llama_cpp": {"server": {"streams": [run(8, 150.0, 60.0), run(32, 160.0, 64.0)]}}}
    text = compute_table(report)
    assert "fp32 400 / bf16 1600 GFLOP/s" in text and "roofline tok/s (not measured" in text
    # 8 streams decode through the fp32 GEMV, 32 through the AMX bf16 GEMM.
    assert "| 8 | 300.0 / 150.0 (2.00x) | 445.0 | 120.0 / 60.0 | 30.0% / 7.5% | 15.0% / 3.8% " \
           "| fp32: 30.0% | n/a | n/a / n/a |  |" in text
    assert "| 32 | 600.0 / 160.0 (3.75x) | 445.0 | 240.0 / 64.0 | 60.0% / 15.0% |" in text
    assert text.endswith("| bf16: 15.0% | n/a | n/a / n/a | >= 2x llama.cpp, >= 50% of the "
                         "ceiling that applies |")
    assert dtype_in_use("fp32", 64) == "fp32" and dtype_in_use("amx-bf16x3", 9) == "bf16"
    # With the roofline: its ceiling, the bound, the full decode step, both shares.
    step = {"rows": 32, "ms": 10.0, "bound": "memory", "bytes": {"total": 2.5e8},
            "flops": {"total": 9e9}}
    report["roofline"]["read_gbs"] = 25.0
    report["kv_cache"] = {"dtype": "float16"}
    for side, tok_s in (("aioengine", 600.0), ("llama_cpp", 160.0)):
        report[side]["server"]["streams"][1]["roofline"] = {
            "tokens_per_s": 2400.0, "bound": "memory", "decode_step": step,
            "share": tok_s / 2400.0}
    text = compute_table(report)
    assert "roofline tok/s (25.0 GB/s; KV float16)" in text
    assert "| bf16: 15.0% | 2400: memory, 32-row step 10.00 ms (memory: 250 MB, 9.00 GFLOP) | " \
           "25.0% / 6.7% | >= 2x" in text


def test_quantized_roofline_uses_the_kv_cache_dtype_the_server_runs() -> None:
    from bench.quantized import flag_value, kv_cache_dtype

    assert flag_value(["--dtype", "x", "--kv-cache-dtype=float16", "--dtype", "y"],
                      "--dtype") == "y"
    assert flag_value(["--kv-cache-dtype=float16"], "--kv-cache-dtype") == "float16"
    assert flag_value(["--dtype"], "--dtype") is None
    # A GGUF file runs fp32 activations on a CPU; "auto" caches K/V in them.
    assert kv_cache_dtype("m.gguf", []) == "float32"
    assert kv_cache_dtype("m.gguf", ["--kv-cache-dtype", "float16"]) == "float16"
    assert kv_cache_dtype("m.gguf", ["--dtype", "bfloat16"]) == "bfloat16"
    with pytest.raises(ValueError):  # the server refuses it too
        kv_cache_dtype("m.gguf", ["--dtype", "bfloat16", "--kv-cache-dtype", "float16"])


def test_quantized_cpu_info_and_binary_lookup(tmp_path: Path) -> None:
    from bench.quantized import cpu_info, find_binary

    cpu = cpu_info()
    assert cpu["model"] and cpu["cpus"] >= 1 and isinstance(cpu["simd_flags"], list)
    assert find_binary("none", "AIOENGINE_TEST_NO_SUCH_VAR", "llama-server") is None
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert find_binary(str(fake), "AIOENGINE_TEST_NO_SUCH_VAR", "llama-server") == fake
    assert find_binary(None, "AIOENGINE_TEST_NO_SUCH_VAR", "llama-bench",
                       beside=tmp_path) is None
    with pytest.raises(SystemExit):
        find_binary(str(tmp_path / "missing"), "AIOENGINE_TEST_NO_SUCH_VAR", "llama-server")


def test_flop_model_matches_a_hand_count_on_the_default_model() -> None:
    from aioengine.config import default_model_path
    from aioengine.models.gguf_file import GGUFFile
    from bench.flops import ModelFlops

    path = default_model_path()
    m = ModelFlops.from_model(path)
    # SmolLM2-135M: h 576, 9 query / 3 KV heads of 64, MLP 1536, 30 layers, V 49152.
    per_layer = 576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536
    assert m.params_per_layer == per_layer == 3_538_944
    # ... and the file's own matrices: every 2-D tensor of a block is a projection,
    # the (tied) token embedding is the LM head.
    tensors = GGUFFile.read(path).tensors
    blk = sum(t.shape[0] * t.shape[1] for n, t in tensors.items()
              if n.startswith("blk.") and len(t.shape) == 2)
    assert blk == m.num_layers * m.params_per_layer
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    assert head.shape[0] * head.shape[1] == m.lm_head_params == 49152 * 576
    # 100 prompt tokens, 128 out: 227 tokens through the layers, 128 LM head rows,
    # attention over 1 + 2 + ... + 227 keys of 4 x 9 x 64 FLOPs in each of 30 layers.
    f = m.request_flops(100, 128)
    assert f["linear"] == 2 * 227 * 30 * per_layer
    assert f["lm_head"] == 2 * 128 * 49152 * 576
    assert f["attention"] == 4 * 9 * 64 * 30 * (227 * 228 // 2)
    assert f["total"] == 57_236_861_952
    # 96 prompt tokens from the prefix cache: neither their projections nor their
    # attention run; the last prompt token always does.
    c = m.request_flops(100, 128, cached_tokens=96)
    assert f["linear"] - c["linear"] == 2 * 96 * 30 * per_layer
    assert f["attention"] - c["attention"] == 4 * 9 * 64 * 30 * (96 * 97 // 2)
    assert m.request_flops(100, 1, cached_tokens=100) == m.request_flops(100, 1, 99)


def test_byte_model_matches_a_hand_count_on_a_tiny_config() -> None:
    from types import SimpleNamespace

    from bench.flops import ModelFlops, WeightBytes, keys_read, step_work

    # keys_read: the union of the queries' windows, against a brute-force count.
    for start, end, window in [(0, 10, None), (3, 10, 4), (8, 10, 4), (5, 6, 4), (2, 3, 4),
                               (0, 1, 1), (4, 4, 2), (7, 20, 3)]:
        keys = {k for p in range(start, end) for k in range(p + 1)
                if window is None or k > p - window}
        assert keys_read(start, end, window) == len(keys), (start, end, window)
    # 2 layers (a 4-key window, then full), 2 query heads and 1 KV head of 4, MLP 16, V 10.
    cfg = SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=16, vocab_size=10,
                          sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    m = ModelFlops.from_config(cfg)
    assert m.kv_bytes_per_key(2) == 2 * 1 * 4 * 2 == 16
    # Tied: a 60-byte embedding (6 bytes a row) is the LM head; 292 bytes in all.
    tied = WeightBytes.from_sizes({"token_embd.weight": 60, "blk.0.attn_q.weight": 100,
                                   "blk.1.attn_q.weight": 100, "output_norm.weight": 32}, 10)
    assert (tied.tied, tied.embedding_row, tied.layers, tied.decode_bytes) == (True, 6, 232, 292)
    # Decode rows at positions 5 and 2 (fp16 KV), both sampling. Keys read: layer 0
    # (window 4) 4 + 3, layer 1 6 + 3 -> 16 keys x 16 bytes; 2 rows x 2 layers written.
    work = step_work(m, tied, 2, [(5, 6, True), (2, 3, True)])
    assert work.rows == 2
    assert work.bytes == {"weights": 292, "kv_read": 16 * 16, "kv_write": 2 * 2 * 16,
                          "total": 292 + 256 + 64}
    per_layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16  # 576
    assert work.flops == {"linear": 2 * 2 * 2 * per_layer, "lm_head": 2 * 2 * 10 * 8,
                          "attention": 4 * 2 * 4 * 16, "total": 4608 + 320 + 512}
    assert work.seconds(1e-6, 1e-6) == (pytest.approx(5.44), "compute")  # 612 B: 0.61 s
    assert work.seconds(1e3, 1e-9)[1] == "memory"
    # A prefill chunk of positions 3..9 that samples nothing: fp32 KV, keys 0..9 read once
    # in the full layer and 0..9 in the window one too (query 3 sees keys 0..3); the LM
    # head is not read, the 7 looked-up embedding rows are.
    work = step_work(m, tied, 4, [(3, 10, False)])
    assert work.bytes == {"weights": 232 + 7 * 6, "kv_read": 32 * (10 + 10),
                          "kv_write": 7 * 2 * 32, "total": 274 + 640 + 448}
    assert work.flops["lm_head"] == 0
    # Untied: a 90-byte LM head, read whole once a row samples; embedding rows per token.
    untied = WeightBytes.from_sizes({"token_embd.weight": 60, "blk.0.attn_q.weight": 100,
                                     "blk.1.attn_q.weight": 100, "output_norm.weight": 32,
                                     "output.weight": 90}, 10)
    assert (untied.tied, untied.layers, untied.decode_bytes) == (False, 232, 232 + 90 + 6)
    assert step_work(m, untied, 2, [(5, 6, True), (2, 3, True)]).bytes["weights"] == 334
    with pytest.raises(ValueError, match="no token embedding"):
        WeightBytes.from_sizes({"blk.0.attn_q.weight": 100}, 10)


def test_workload_roofline_sums_each_step_bound_over_lock_step_waves() -> None:
    from types import SimpleNamespace

    from bench.flops import ModelFlops, WeightBytes, step_work, workload_roofline, workload_steps

    cfg = SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=16, vocab_size=10)
    m = ModelFlops.from_config(cfg)
    w = WeightBytes.from_sizes({"token_embd.weight": 60, "blk.0.attn_q.weight": 1000}, 10)
    # 3 requests (prompt 3, 2 tokens out; one with 2 cached prompt tokens; one failed,
    # left out) on 2 streams: waves [a, b] and [c], each a prefill step and a decode step.
    reqs = [{"prompt_len": 3, "output_len": 2, "cached_tokens": 0, "start_s": 0.1},
            {"prompt_len": 3, "output_len": 2, "cached_tokens": 2, "start_s": 0.0},
            {"ok": False, "prompt_len": 3, "output_len": 0, "start_s": 0.05},
            {"prompt_len": 3, "output_len": 2, "start_s": 0.2}]
    steps = workload_steps(reqs, 2)
    assert steps == [("prefill", [(2, 3, True), (0, 3, True)]),
                     ("decode", [(3, 4, True), (3, 4, True)]),
                     ("prefill", [(0, 3, True)]), ("decode", [(3, 4, True)])]
    # Steps of 3+ rows compute at 1e-6 GFLOP/s (compute-bound), the rest at 1e6.
    def peak(rows: int) -> float:
        return 1e-6 if rows > 2 else 1e6

    works = [step_work(m, w, 2, seqs) for _, seqs in steps]
    bounds = [wk.seconds(peak(wk.rows), 1e-6) for wk in works]
    assert [b for _, b in bounds] == ["compute", "memory", "compute", "memory"]
    r = workload_roofline(m, w, 2, reqs, 2, peak, 1e-6)
    assert r["seconds"] == pytest.approx(sum(s for s, _ in bounds))
    assert r["tokens_per_s"] == pytest.approx(6 / r["seconds"])
    assert r["prefill_s"] == pytest.approx(bounds[0][0] + bounds[2][0])
    assert r["memory_bound_s"] == pytest.approx(bounds[1][0] + bounds[3][0])
    # The widest decode step: 2 rows, memory-bound, bytes / bandwidth in ms.
    step = r["decode_step"]
    assert step["rows"] == 2 and step["bound"] == "memory"
    assert step["ms"] == pytest.approx(works[1].bytes["total"] / 1e3 * 1e3)
    assert step["bytes"]["weights"] == 1060 and step["bytes"]["kv_read"] == 2 * 2 * 16 * 4


def test_weight_bytes_of_the_default_model_are_its_quantized_blocks() -> None:
    from aioengine.config import default_model_path
    from bench.flops import ModelFlops, WeightBytes

    path = default_model_path()
    m, w = ModelFlops.from_model(path), WeightBytes.from_gguf(path)
    # SmolLM2-135M Q4_1: projections in Q4_1 (20 bytes per 32 weights), norms fp32,
    # the tied embedding / LM head Q8_0 (34 bytes per 32).
    norms = 4 * (2 * m.num_layers + 1) * m.hidden_size
    assert w.tied and w.lm_head == w.embedding == m.lm_head_params // 32 * 34
    assert w.layers == m.num_layers * m.params_per_layer // 32 * 20 + norms
    assert w.decode_bytes == w.total == 96_576_768


def test_flop_model_sliding_windows_and_run_totals() -> None:
    from types import SimpleNamespace

    from bench.flops import ModelFlops, keys_attended, run_flops, shares

    for start, end, window in [(0, 10, None), (3, 40, 16), (20, 30, 16), (0, 5, 16), (7, 7, 4)]:
        assert keys_attended(start, end, window) == sum(
            min(p + 1, window or p + 1) for p in range(start, end))
    cfg = SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2,
                          intermediate_size=16, vocab_size=10, sliding_window=4,
                          layer_types=["sliding_attention", "full_attention"])
    m = ModelFlops.from_config(cfg)
    assert m.windows == (4, None) and m.num_kv_heads == 2 and m.head_dim == 4
    assert m.attention_flops(0, 6) == 4 * 8 * ((1 + 2 + 3 + 4 + 4 + 4) + 21)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelFlops.from_config(SimpleNamespace(**vars(cfg), num_local_experts=8))
    run = {"duration_s": 2.0, "cached_prompt_tokens": 3,
           "requests": [{"ok": True, "prompt_len": 5, "output_len": 4},
                        {"ok": True, "prompt_len": 5, "output_len": 4},
                        {"ok": False, "prompt_len": 5, "output_len": 0}]}
    out = run_flops(m, run)  # older records: the run's cached tokens on one request
    want = m.request_flops(5, 4, 3)["total"] + m.request_flops(5, 4)["total"]
    assert out["flops"]["total"] == want and out["output_tokens"] == 8
    assert out["gflops"] == pytest.approx(want / 2.0 / 1e9)
    for r in run["requests"]:
        r["cached_tokens"] = 0
    assert run_flops(m, run)["flops"]["total"] == 2 * m.request_flops(5, 4)["total"]
    assert shares(50.0, {"fp32_gemm_gflops": 200.0, "bf16_gemm_gflops": 1000.0}) == {
        "fp32": 0.25, "bf16": 0.05}


@pytest.mark.slow
def test_quantized_script_measures_ours_without_llama_cpp(tmp_path: Path) -> None:
    out = tmp_path / "quantized.json"
    proc = run_script("quantized.py", "--llama-server", "none", "--concurrency", "1,2",
                      "--prompt-len", "8", "--max-tokens", "3", "--requests-per-stream", "1",
                      "--batch1-tokens", "4", "--time-limit", "300", "--restart-timeout", "300",
                      "--ceiling-time", "0.1", "--bandwidth-gb", "0.2",
                      "--output-json", str(out), "--plot-dir", str(tmp_path), "--no-progress")
    assert proc.stdout.startswith("CPU: ")
    assert "llama-server not found" in proc.stdout
    report = json.loads(out.read_text())
    assert "llama_cpp" not in report and report["ratios"] == {}
    ours = report["aioengine"]
    assert ours["batch1"]["decode_tokens_per_s"] > 0
    server = ours["server"]
    assert server["ready_s"] > 0
    assert [r["concurrency"] for r in server["streams"]] == [1, 2]
    for run in server["streams"]:
        assert run["completed"] == run["num_requests"], run["errors"]
        for metric in ("ttft", "tpot", "itl", "e2e"):
            assert set(run[metric]) == LATENCY_KEYS
    assert server["worker_memory"]["rss_mib"] > 0 and server["server_memory"]["rss_mib"] > 0
    # KV cache matched to llama-server's: float16, 2 slots x (8 + 3 + 32) tokens = 6 blocks.
    assert report["kv_cache"]["server_args"] == ["--kv-cache-dtype", "float16",
                                                 "--num-gpu-blocks-override", "6"]
    roof = report["roofline"]
    assert roof["read_gbs"] > 0 and 50 < roof["decode_weight_mb"] < 200
    assert roof["batch1_roofline_tokens_per_s"] == pytest.approx(
        roof["read_gbs"] * 1e3 / roof["decode_weight_mb"])
    # The killed worker was restarted and answered again.
    assert server["restart"]["serving_again_s"] > 0
    assert report["cpu"]["model"] and "aioengine serve" in report["table_markdown"]
    assert (tmp_path / "quantized_vs_llama_cpp.png").stat().st_size > 0
    # Compute share (issue 16): both GEMM ceilings measured; each run's FLOPs are the
    # FLOP model's on the requests served, over the run's duration.
    assert roof["fp32_gemm_gflops"] > 0 and roof["bf16_gemm_gflops"] > 0
    from bench.flops import ModelFlops

    model = ModelFlops.from_model(report["args"]["model"])
    for run in server["streams"]:
        want = sum(model.request_flops(r["prompt_len"], r["output_len"],
                                       r["cached_tokens"])["total"] for r in run["requests"])
        assert run["compute"]["flops"]["total"] == want
        assert run["compute"]["gflops"] == pytest.approx(want / run["duration_s"] / 1e9)
        assert run["compute"]["share"]["bf16"] == pytest.approx(
            run["compute"]["gflops"] / roof["bf16_gemm_gflops"])
    assert "% of fp32 / bf16 GEMM" in report["compute_table_markdown"]
    assert (tmp_path / "quantized_concurrency.png").stat().st_size > 0
    # Roofline: the read bandwidth best of 5 passes (and again after the load), each
    # run's ceiling from its own requests in the server's KV dtype (float16, matched).
    assert roof["read_gbs"] == pytest.approx(
        max(roof["read_by_pass"] + roof["read_end_by_pass"]), abs=0.01)
    assert report["kv_cache"]["dtype"] == "float16"
    from bench.flops import WeightBytes, workload_roofline
    from bench.quantized import dtype_in_use

    weights = WeightBytes.from_gguf(report["args"]["model"])
    for run in server["streams"]:
        rl = run["roofline"]
        want = workload_roofline(
            model, weights, 2, run["requests"], run["concurrency"],
            lambda rows: roof[f"{dtype_in_use(report['gemm_path'], rows)}_gemm_gflops"],
            roof["read_gbs"])
        assert rl["tokens_per_s"] == pytest.approx(want["tokens_per_s"])
        assert rl["share"] == pytest.approx(run["output_throughput"] / rl["tokens_per_s"])
        assert rl["decode_step"]["rows"] == run["concurrency"]
    assert "% of roofline" in report["compute_table_markdown"]


def test_spec_decode_script_compares_both_engines(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    run_script("spec_decode.py", "--quick", "--out", str(out), "--plot", str(tmp_path / "s.png"))
    report = json.loads(out.read_text())
    assert {"grounded", "grounded_total", "summarise", "open_chat", "concurrent",
            "spec_stats", "cpu"} <= set(report)
    assert report["spec_stats"]["spec_decode_num_drafts"] > 0
    assert (tmp_path / "s.png").stat().st_size > 0
