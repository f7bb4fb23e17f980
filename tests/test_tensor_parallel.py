"""Tensor parallelism (services/worker/tensor_parallel.py): TP=2 over gloo, one thread per rank,
gives the logits of TP=1 on tiny random Llamas whose KV heads are split, split unevenly and
replicated (with biases, an uneven MLP split and a padded vocabulary), and on SmolLM2 (fp32)."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rill.services.worker.llama import LlamaModel
from rill.services.worker.tensor_parallel import Shard, TensorParallelError
from rill.shared.config import ModelConfig

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tp_case import steps  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny(path: Path, kv_heads: int, bias: bool) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(kv_heads)
    cfg = LlamaConfig(vocab_size=301, hidden_size=48, intermediate_size=37, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      initializer_range=0.2, attention_bias=bias, mlp_bias=bias, tie_word_embeddings=not bias)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def run_ranks(size: int, out: Path, model_dirs: list[str], timeout: float = 120) -> None:
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(HERE / "tp_case.py"), str(r), str(size), address, str(out),
                               *model_dirs], env=env) for r in range(size)]
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


def test_tp2_logits_equal_tp1(tmp_path: Path) -> None:
    dirs = [tiny(tmp_path / f"kv{k}", k, bias=k == 3) for k in (1, 2, 3)]
    run_ranks(2, tmp_path, dirs)
    torch.set_num_threads(2)
    for i, d in enumerate(dirs):
        want = steps(LlamaModel.load(d, torch.float32))
        got = torch.load(tmp_path / f"logits-{i}.pt")
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4, msg=lambda m, d=d: f"{d}: {m}")
        assert torch.equal(got.argmax(-1), want.argmax(-1))
