"""Tensor parallelism across two "hosts" on one machine (issue 21).

Node 0 (``aioengine serve --nnodes 2 --node-rank 0``) serves the API on
127.0.0.1 and runs rank 0; node 1 (``--node-rank 1 --node-addr 127.0.0.2``)
runs rank 1 only, its gloo sockets bound to 127.0.0.2, fed by rank 0's step
broadcast. On a random-weight Llama with 8 query heads and 2 KV heads:

- node 1's rank listens on 127.0.0.2, not 127.0.0.1;
- greedy tokens over HTTP equal TP=1's (in-process ``LLM``), near-tie rule;
- node 1 frozen (SIGSTOP: a host that drops without closing its sockets) ends
  every in-flight request with an error within 5 s (the collective timeout), and
  the same node 1 process rejoins once it runs again, on its spare rank;
- SIGKILL of node 1's process ends every in-flight request with an error within
  5 s; node 0 reports unhealthy, and serves the same tokens again once node 1
  is restarted.

The default model (9 heads, 3 KV heads) is refused at TP=2 on both nodes, in
one line with status 1, before anything loads. The step broadcast itself (a
message longer than its inline buffer, heartbeats) runs between two real
processes, and the flags and torchrun's variables map onto the config.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from conftest import REPO_ROOT, ServerInfo, free_port, start_server, stop_server
from parity import assert_greedy_parity
from reliability_util import _children, pid_alive, sse_request, wait_until

from aioengine import LLM, SamplingParams
from aioengine.config import EngineConfig
from aioengine.distributed.layout import NodeLayout, torchrun_env
from aioengine.entrypoints.cli import build_parser, engine_kwargs

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Explain gravity to a child."]
NEW_TOKENS = 16
NODE0, NODE1 = "127.0.0.1", "127.0.0.2"
MODEL_NAME = "llama-8q-2kv-long"


def make_model(root: Path, tokenizer_dir: Path) -> Path:
    """A 2-layer Llama with 8 query heads and 2 KV heads, random weights (std
    0.1: greedy picks are rarely near-ties) and a 2048-token context, so a long
    request stays in flight for seconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = root / MODEL_NAME
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=2048, rope_theta=10000.0,
                         tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(2)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "aioengine.entrypoints.cli", "serve", *args]


def start_node1(log: Path, model: Path, master_port: int) -> subprocess.Popen:
    out = open(log, "ab")  # noqa: SIM115 - the node writes to it for its whole life
    try:
        return subprocess.Popen(
            cli("--model", str(model), "-tp", "2", "--nnodes", "2", "--node-rank", "1",
                "--master-addr", NODE0, "--master-port", str(master_port),
                "--node-addr", NODE1, "--num-threads", "1", "--kv-cache-memory", "0.05",
                "--log-level", "info"),
            cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    finally:
        out.close()


def listening_addrs(pid: int) -> set[str]:
    """IPv4 addresses the process's listening TCP sockets are bound to."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addrs = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
            ip = bytes.fromhex(fields[1].split(":")[0])[::-1]
            addrs.add(".".join(str(b) for b in ip))
    return addrs


def rank_pids(parent: int, comm: str) -> list[int]:
    out = []
    for kid in _children(parent):
        try:
            if Path(f"/proc/{kid}/comm").read_text().strip() == comm:
                out.append(kid)
        except OSError:
            pass
    return out


def api_token(tokenizer, token_id: int) -> str:
    """A token as the completions API names it (``serving.completion_token_str``):
    its text, or for part of a UTF-8 character its bytes (``bytes:\\xa7``)."""
    from aioengine.entrypoints.serving import _raw_token_bytes

    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text
    return "bytes:" + "".join(f"\\x{b:02x}" for b in _raw_token_bytes(tokenizer, token_id))


def complete(info: ServerInfo, prompt: str) -> tuple[list[str], list[list[float]]]:
    """Greedy tokens (as the completions API names them) and their top-2 logprobs."""
    r = httpx.post(f"{info.base_url}/v1/completions", headers=info.headers, timeout=60, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
        "ignore_eos": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], [sorted(t.values(), reverse=True)[:2] for t in lp["top_logprobs"]]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir) -> Path:
    return make_model(tmp_path_factory.mktemp("multihost"), tokenizer_dir)


@pytest.fixture(scope="module")
def tp1(model) -> list[tuple[list[str], list[list[float]]]]:
    """TP=1 greedy tokens, rendered as the completions API names them."""
    llm = LLM(str(model), executor="inproc", num_threads=1, num_gpu_blocks_override=64)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                    ignore_eos=True, logprobs=2),
                            use_tqdm=False)
        tok = llm.tokenizer
        return [([api_token(tok, t) for t in o.outputs[0].token_ids],
                 [sorted(lp.values(), reverse=True)[:2] for lp in o.outputs[0].logprobs])
                for o in outs]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def two_nodes(model, tmp_path_factory) -> Iterator[tuple[ServerInfo, dict]]:
    """Node 1 (headless, 127.0.0.2) started first, then node 0 (API on 127.0.0.1)."""
    tmp = tmp_path_factory.mktemp("nodes")
    port = free_port()
    node1 = {"log": tmp / "node1.log", "port": port}
    node1["proc"] = start_node1(node1["log"], model, port)
    info = None
    try:
        info = start_server(tmp, "--model", str(model), "-tp", "2", "--nnodes", "2",
                            "--node-rank", "0", "--master-addr", NODE0, "--master-port",
                            str(port), "--executor", "process", "--num-threads", "1",
                            "--kv-cache-memory", "0.05", "--log-level", "info")
        yield info, node1
    finally:
        if info is not None:  # node 0 first: its ranks tell node 1's to stop
            stop_server(info)
        node1["proc"].kill()
        node1["proc"].wait()


# -- refused before anything loads ---


def test_default_model_tp2_across_two_nodes_is_refused_in_one_line():
    """9 heads and 3 KV heads do not split over 2 ranks: both nodes say so and exit 1."""
    common = ["-tp", "2", "--nnodes", "2", "--master-addr", NODE0, "--master-port", "29499"]
    procs = [subprocess.Popen(cli(*common, "--node-rank", "0", "--port", str(free_port())),
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True),
             subprocess.Popen(cli(*common, "--node-rank", "1", "--node-addr", NODE1),
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, (out, err)
        assert err.strip() == ("aioengine: error: tensor_parallel_size 2 does not divide the "
                               "model's 9 attention heads"), err


def test_flags_and_torchrun_variables_map_onto_the_node_layout(monkeypatch):
    parser = build_parser()
    args = parser.parse_args(["serve", "-tp", "4", "--nnodes", "2", "--node-rank", "1",
                              "--master-addr", "10.0.0.1", "--master-port", "1234",
                              "--node-addr", "10.0.0.2", "--dist-timeout", "7"])
    p = EngineConfig.from_kwargs(**engine_kwargs(args)).parallel
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port, p.node_addr,
            p.distributed_timeout_s) == (2, 1, "10.0.0.1", 1234, "10.0.0.2", 7.0)
    assert list(p.node_layout.local_ranks) == [2, 3]
    assert NodeLayout(2, 0, 4).remote_ranks == (2, 3)
    with pytest.raises(ValueError, match="cannot be spread evenly over 2 nodes"):
        EngineConfig.from_kwargs(**engine_kwargs(parser.parse_args(
            ["serve", "-tp", "3", "--nnodes", "2"])))
    with pytest.raises(ValueError, match="--node-rank and --master-addr need --nnodes"):
        engine_kwargs(parser.parse_args(["serve", "-tp", "2", "--node-rank", "1"]))
    # Without --nnodes these would be ignored: refused in one line instead.
    for flags, message in ((["--master-port", "1234"], "--master-port needs --nnodes"),
                           (["--node-addr", "10.0.0.2"], "--node-addr needs --nnodes"),
                           (["--dist-timeout", "7"], "--dist-timeout needs --nnodes")):
        with pytest.raises(ValueError, match=message):
            engine_kwargs(parser.parse_args(["serve", "-tp", "2", *flags]))
    for timeout in ("nan", "inf"):  # a NaN or endless timeout never notices a dropped host
        with pytest.raises(ValueError, match="distributed_timeout_s must be positive and finite"):
            EngineConfig.from_kwargs(**engine_kwargs(parser.parse_args(
                ["serve", "-tp", "2", "--nnodes", "2", "--dist-timeout", timeout])))
    with pytest.raises(ValueError, match="node_rank 2 is not in"):
        EngineConfig.from_kwargs(**engine_kwargs(parser.parse_args(
            ["serve", "-tp", "2", "--nnodes", "2", "--node-rank", "2"])))
    # torchrun --nnodes 2 --nproc-per-node 1: each process is one node; the group
    # meets one port above torchrun's own store.
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert torchrun_env() is not None
    p = EngineConfig.from_kwargs(**engine_kwargs(parser.parse_args(
        ["serve", "-tp", "2", "--dist-timeout", "7"]))).parallel
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port) == (2, 1, "10.0.0.1", 29501)
    assert p.distributed_timeout_s == 7.0  # kept under torchrun
    with pytest.raises(ValueError, match="it comes from MASTER_PORT"):
        engine_kwargs(parser.parse_args(["serve", "-tp", "2", "--master-port", "1234"]))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert torchrun_env() is None


STEP_CHANNEL_SCRIPT = textwrap.dedent("""
    import os, sys
    from aioengine.distributed import parallel_state
    from aioengine.distributed.layout import DistInit
    from aioengine.distributed.step_channel import INLINE_BYTES, StepChannel
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    parallel_state.init_multi_node(DistInit(rank, 2, f"tcp://127.0.0.1:{port}", 1,
        remote_ranks=(1,), node_addr=["127.0.0.1", "127.0.0.2"][rank],
        rendezvous_timeout_s=60))
    parallel_state.set_collective_timeout(2)
    channel = StepChannel(parallel_state.step_group())
    messages = [b"short", bytes(range(256)) * (3 * INLINE_BYTES // 256 + 1), b""]
    if rank == 0:
        channel.send(messages[0]); channel.heartbeat(); channel.send(messages[1])
        channel.send(messages[2])
        os._exit(0)  # as a dead rank: no teardown of the group
    got = [channel.recv() for _ in range(4)]
    assert got == [messages[0], None, messages[1], messages[2]], [len(g or b"") for g in got]
    try:
        channel.recv()  # rank 0 has exited: its sockets closed
    except Exception as exc:
        print("peer gone:", type(exc).__name__, flush=True)
        os._exit(0)
    os._exit(1)
""")


def test_step_channel_between_two_processes():
    """Short and long (second broadcast) messages and a heartbeat arrive as sent;
    once rank 0 exits, the next receive raises instead of waiting."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", STEP_CHANNEL_SCRIPT, str(rank), str(port)],
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "peer gone" in outs[1]


# -- two nodes serving ---


def test_node1_rank_binds_its_own_address(two_nodes):
    _, node1 = two_nodes
    (rank1,) = rank_pids(node1["proc"].pid, "aioengine-wrk1")
    addrs = listening_addrs(rank1)
    assert NODE1 in addrs and NODE0 not in addrs, addrs


def test_greedy_over_http_equals_tp1(two_nodes, tp1):
    info, _ = two_nodes
    ties = []
    for prompt, (ref_tokens, ref_top2) in zip(PROMPTS, tp1):
        tokens, top2 = complete(info, prompt)
        # Token strings stand for ids here: equal strings at every position are the
        # same greedy path (a differing token would show as a differing string).
        ours_ids = [i if a == b else -1 for i, (a, b) in enumerate(zip(tokens, ref_tokens))]
        ties.append(assert_greedy_parity(f"TP=2 over 2 nodes {prompt!r}", ours_ids,
                                         list(range(len(ref_tokens))), top2, ref_top2))
    assert sum(t is None for t in ties) >= len(ties) - 1, ties


async def _in_flight_then_kill(info: ServerInfo, kill) -> tuple[list, float]:
    """Four long streams; once each has tokens, ``kill()``; how they ended and
    the seconds from the kill to the last one's end."""
    async with httpx.AsyncClient(base_url=info.base_url, headers=info.headers,
                                 timeout=60) as client:
        started = [asyncio.Event() for _ in range(4)]
        body = {"model": MODEL_NAME, "max_tokens": 1600, "temperature": 0, "ignore_eos": True}
        tasks = [asyncio.create_task(sse_request(
            client, {**body, "prompt": f"Story number {i}: " + "once upon a time " * 80},
            started=started[i], path="/v1/completions")) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        assert not any(t.done() for t in tasks)
        t_kill = time.monotonic()
        kill()
        outcomes = await asyncio.gather(*tasks)
    return outcomes, max(o.ended_at for o in outcomes) - t_kill


def _healthy(info: ServerInfo) -> bool:
    try:
        return httpx.get(f"{info.base_url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_silently_dropped_node1_fails_requests_within_5s_and_rejoins(two_nodes):
    """A host that drops without closing its sockets (SIGSTOP: no FIN, no RST) is
    noticed by the collective timeout (``--dist-timeout``, default 4 s); once it
    is back, the same node 1 process rejoins the rebuilt group by itself."""
    info, node1 = two_nodes
    before = complete(info, PROMPTS[2])[0]
    agent = node1["proc"].pid
    (rank1,) = rank_pids(agent, "aioengine-wrk1")
    # Node 1 keeps a spare rank (imports done) once its rank joined.
    assert wait_until(lambda: len(rank_pids(agent, "aioengine-sby1")) == 1, timeout=30)
    (spare,) = rank_pids(agent, "aioengine-sby1")
    frozen = (agent, rank1, spare)

    def freeze() -> None:
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)

    try:
        outcomes, seconds = asyncio.run(_in_flight_then_kill(info, freeze))
        print(f"node 1 frozen: the last in-flight request ended {seconds:.2f} s later")
        assert [o.kind for o in outcomes] == ["error"] * 4, outcomes
        assert seconds < 5.0, seconds
        assert wait_until(lambda: not _healthy(info), timeout=5)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    assert wait_until(lambda: _healthy(info), timeout=120, interval=0.2), info.log_tail()
    assert node1["proc"].poll() is None and not pid_alive(rank1)
    assert rank_pids(agent, "aioengine-wrk1") == [spare]  # the spare rejoined
    assert complete(info, PROMPTS[2])[0] == before


def test_killed_node1_fails_requests_within_5s_and_serving_resumes(two_nodes, model, tp1):
    info, node1 = two_nodes
    before = complete(info, PROMPTS[0])[0]
    outcomes, seconds = asyncio.run(_in_flight_then_kill(info, node1["proc"].kill))
    print(f"node 1 killed: the last in-flight request ended {seconds:.2f} s later")
    node1["proc"].wait()
    assert [o.kind for o in outcomes] == ["error"] * 4, outcomes
    assert seconds < 5.0, seconds
    assert wait_until(lambda: not _healthy(info), timeout=5)
    # A new node 1 process: node 0's rebuilt group admits it.
    node1["proc"] = start_node1(node1["log"], model, node1["port"])
    assert wait_until(lambda: _healthy(info), timeout=120, interval=0.2), info.log_tail()
    assert complete(info, PROMPTS[0])[0] == before
