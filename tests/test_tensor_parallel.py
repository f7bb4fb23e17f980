"""Tensor parallelism (services/worker/tensor_parallel.py). At model level, TP=2 over gloo (one
thread per rank) gives TP=1's logits on tiny random Llamas whose KV heads are split, split
unevenly and replicated (with biases, an uneven MLP split and a padded vocabulary), on tiny
Phi-3 and Gemma 3, through the torch and the (interpreted) Triton kernels. Through the whole pipeline, `rill serve
--tensor-parallel-size 2` on SmolLM2 fp32 keeps greedy parity through chunked prefill, a
prefix hit and preemption, and a killed rank fails its engine's requests, then both restart."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
import redis
import torch
from test_e2e import assert_same_or_near_tie, chat_ids, hf_greedy
from tp_case import steps

from rill.kernels import ops
from rill.services.cli import build_parser, engine_args
from rill.services.supervisor import children_of
from rill.services.worker.llama import LlamaModel
from rill.services.worker.tensor_parallel import Shard, TPGroup
from rill.services.worker.tp_support import TensorParallelError, check_supported
from rill.shared.broker import free_port
from rill.shared.config import ModelConfig
from rill.shared.schema import EngineStats
from rill.shared.streams import Streams

HERE = Path(__file__).resolve().parent


def tiny(path: Path, kv_heads: int, bias: bool) -> str:
    """A random 2-layer Llama checkpoint (6 query heads of 8 dims, an MLP of 37 and a vocabulary of
    301, so neither splits evenly); `bias`: every projection has one and the LM head is untied."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(kv_heads)
    hidden, ff, vocab, d = 48, 37, 301, 8

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": 1 + rand(hidden)}
    if bias:
        tensors["lm_head.weight"] = rand(vocab, hidden)
    for i in range(2):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (6 * d, hidden), "self_attn.k_proj": (kv_heads * d, hidden),
                  "self_attn.v_proj": (kv_heads * d, hidden), "self_attn.o_proj": (hidden, 6 * d),
                  "mlp.gate_proj": (ff, hidden), "mlp.up_proj": (ff, hidden), "mlp.down_proj": (hidden, ff)}
        for name, shape in shapes.items():
            tensors[f"{p}{name}.weight"] = rand(*shape)
            if bias:
                tensors[f"{p}{name}.bias"] = rand(shape[0])
        tensors[f"{p}input_layernorm.weight"] = 1 + rand(hidden)
        tensors[f"{p}post_attention_layernorm.weight"] = 1 + rand(hidden)
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": ff, "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": kv_heads,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": not bias, "attention_bias": bias, "mlp_bias": bias, "eos_token_id": 2}))
    return str(path)


def run_ranks(size: int, out: Path, model_dirs: list[str], timeout: float = 120) -> None:
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(HERE / "tp_case.py"), str(r), str(size), address, str(out),
                               "cpu", *model_dirs], env=env) for r in range(size)]
    for p in procs:
        assert p.wait(timeout) == 0


def test_shard_plan_covers_every_head_once() -> None:
    """Every query head on exactly one rank, each rank's KV heads those its query heads use."""
    for heads, kv, size in ((6, 3, 2), (6, 1, 2), (8, 2, 4), (9, 3, 2), (4, 4, 3)):
        cfg = ModelConfig(vocab_size=10, hidden_size=8 * heads, intermediate_size=5, num_hidden_layers=1,
                          num_attention_heads=heads, num_key_value_heads=kv, head_dim=8, rms_norm_eps=1e-6,
                          rope_theta=1e4, max_position_embeddings=8, tie_word_embeddings=True)
        shards = [Shard.plan(cfg, r, size) for r in range(size)]
        assert sorted(h for s in shards for h in s.q_heads) == list(range(heads))
        for s in shards:
            assert {h * kv // heads for h in s.q_heads} == set(s.kv_heads)
        assert sorted(i for s in shards for i in s.vocab) == list(range(10))
    with pytest.raises(TensorParallelError, match="cannot split"):
        Shard.plan(dataclasses.replace(cfg, num_attention_heads=4, num_key_value_heads=2), 0, 3)


def test_a_group_that_does_not_form_fails_clearly() -> None:
    """Rank 1 with nobody at the address, and rank 0 whose peer never comes: one clear error each."""
    for rank in (1, 0):
        with pytest.raises(TensorParallelError, match=f"rank {rank} of 2: the group at .* did not form within 1 s"):
            TPGroup.join(rank, 2, f"127.0.0.1:{free_port()}", "cpu", timeout_s=1)


def test_refused_with_tp_by_name(tmp_path: Path) -> None:
    model_dir = tiny(tmp_path / "m", 2, bias=False)
    for argv, why in ((["--role", "prefill"], "prefill/decode engines"), (["--quantization", "int8"], "int8"),
                      (["--tp-rank", "2"], "--tp-rank must be in 0..1")):
        ns = build_parser().parse_args(["service", "worker", "--tensor-parallel-size", "2", *argv])
        with pytest.raises(SystemExit, match=why):
            engine_args(ns, model_dir)
    ns = build_parser().parse_args(["serve", "--tp-size", "2", "--prefill-engines", "1", "--decode-engines", "1"])
    with pytest.raises(SystemExit, match="prefill/decode engines"):
        engine_args(ns, model_dir)
    with pytest.raises(TensorParallelError, match="the mixtral family"):
        check_supported("mixtral", "none", 2)


def test_tp2_logits_equal_tp1(tmp_path: Path) -> None:
    """Also Phi-4-mini (fused qkv and gate_up, sliced in parts; RoPE over part of each head) and Gemma 3 (scaled embedding, q/k
    norms, soft-capped logits); the last run goes through the Triton kernels (interpreted), and its decode
    step also through DecodeGraphs' padded step (what a CUDA graph captures, with the gather after)."""
    from test_model_families import build

    dirs = [tiny(tmp_path / f"kv{k}", k, bias=k == 3) for k in (1, 2, 3)]
    for family in ("phi4-mini", "gemma3"):
        (tmp_path / family).mkdir()
        dirs.append(str(build(tmp_path / family, family)[0]))
    dirs.append(f"triton:{dirs[1]}")
    run_ranks(2, tmp_path, dirs)
    torch.set_num_threads(2)
    for i, d in enumerate(dirs):
        ops.set_backend("triton" if d.startswith("triton:") else None)
        try:
            want = steps(LlamaModel.load(d.removeprefix("triton:"), torch.float32))
        finally:
            ops.set_backend(None)
        got = torch.load(tmp_path / f"logits-{i}.pt")
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4, msg=lambda m, d=d: f"{d}: {m}")
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        if d.startswith("triton:"):  # the padded decode step a CUDA graph captures, gathered after it
            graphed = torch.load(tmp_path / f"graph-{i}.pt")
            torch.testing.assert_close(graphed, want[-2:], atol=2e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# The whole pipeline: rill serve --tensor-parallel-size 2 (supervised ranks), SmolLM2 fp32


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    stats_key: str
    redis: redis.Redis

    def stats(self) -> EngineStats:
        return msgspec.msgpack.decode(self.redis.get(self.stats_key), type=EngineStats)

    def health(self) -> int:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code
        except httpx.HTTPError:
            return 0

    def rank_pid(self, rank: int) -> int:
        return next(pid for pid, cmd in children_of(self.proc.pid).items() if f"--tp-rank {rank} " in cmd)


@pytest.fixture(scope="module")
def served(redis_url: str, smollm2_dir: str) -> Iterator[Served]:
    """Small blocks, a 32-token step budget (prompts prefill in chunks) and a cache of 12 blocks
    on rank 0 (three requests at once preempt)."""
    prefix, port = f"rilltp-{os.getpid()}", free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rill.services.cli", "serve", smollm2_dir, "--redis-url", redis_url,
                             "--prefix", prefix, "--port", str(port), "--tensor-parallel-size", "2",
                             "--dtype", "float32", "--quantization", "none", "--block-size", "8", "--max-num-batched-tokens", "32",
                             "--max-num-seqs", "8", "--kv-cache-memory", "3MiB", "--max-model-len", "96",
                             "--shutdown-timeout", "1"],
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    s = Served(proc, f"http://127.0.0.1:{port}", Streams(prefix).stats_key(0), redis.Redis.from_url(redis_url))
    try:
        deadline = time.monotonic() + 240
        while not (s.redis.exists(s.stats_key) and s.health() == 200):
            assert proc.poll() is None and time.monotonic() < deadline, "rill serve did not become ready"
            time.sleep(0.5)
        yield s
    finally:
        proc.terminate()
        proc.wait(60)


def test_tp2_pipeline_greedy_matches_transformers(served: Served, smollm2_dir: str) -> None:
    """Chunked prefill, prefix-cache hits (the chat template's system prompt) and preemptions on
    the way: the text is still the reference's greedy text (test_e2e holds TP=1 to the same)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
               "Explain how a bicycle works to a ten year old, step by step.",
               "What are the main differences between Python and C? Answer in detail."]

    async def ask(client: httpx.AsyncClient, prompt: str) -> dict:
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 16})
        assert r.status_code == 200, r.text
        return r.json()

    async def session() -> list[dict]:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            return await asyncio.gather(*(ask(client, p) for p in prompts))

    for prompt, resp in zip(prompts, asyncio.run(session()), strict=True):
        ids = chat_ids(tok, prompt)
        n = resp["usage"]["completion_tokens"]
        assert_same_or_near_tie(tok, model, ids, hf_greedy(model, ids, n), resp["choices"][0]["message"]["content"])
    st = served.stats()
    assert st.preemptions > 0 and st.prefix_cache_hits + st.prefix_cache_preempted_hits > 0, st


def test_tp2_dead_rank_fails_requests_then_ranks_restart(served: Served) -> None:
    """A killed rank takes its group down and both ranks start again. The requests in flight
    either fail with a clear error within 10 s, or (when the group is back before the heartbeat
    grace runs out, as on a fast host) are recomputed and finish with the text they would have had
    anyway, each token once."""
    prompts = [f"Tell me about {t}." for t in ("rain", "tea", "snow")]
    body = {"max_tokens": 60, "temperature": 0, "ignore_eos": True}

    async def one(client: httpx.AsyncClient, prompt: str, seen: list[str]) -> tuple[str | None, str, float]:
        error, text = None, ""
        async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt, "stream": True}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    obj = json.loads(line[6:])
                    error = obj.get("error", {}).get("message", error)
                    text += "".join(c.get("text", "") for c in obj.get("choices", []))
                    seen.append(prompt)
        return error, text, time.monotonic()

    async def load() -> tuple[list[tuple[str | None, str, float]], float]:
        seen: list[str] = []
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            tasks = [asyncio.create_task(one(client, p, seen)) for p in prompts]
            while len(set(seen)) < 3:
                await asyncio.sleep(0.05)
            killed_at = time.monotonic()
            os.kill(served.rank_pid(1), signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 30), killed_at

    old_rank0 = served.rank_pid(0)
    ends, killed_at = asyncio.run(load())
    deadline = time.monotonic() + 180
    while served.health() != 200:  # both ranks started again, together
        assert time.monotonic() < deadline, "the engine did not come back"
        time.sleep(0.5)
    assert served.rank_pid(0) != old_rank0, "rank 0 kept running without rank 1"
    for prompt, (error, text, ended) in zip(prompts, ends, strict=True):
        if error is not None:
            assert "engine is not available" in error, error
            assert ended - killed_at < 10, f"failed {ended - killed_at:.1f}s after the kill"
            continue
        r = httpx.post(f"{served.url}/v1/completions", json={**body, "prompt": prompt}, timeout=60)
        assert r.status_code == 200, r.text
        assert text == r.json()["choices"][0]["text"], "a recomputed request's stream differs from its greedy text"
    r = httpx.post(f"{served.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
