"""Every family through the whole pipeline: a tiny random checkpoint of the family (family_cases.py)
with SmolLM2's tokenizer, served by one stack of separate processes over the real broker, with a
chunk budget smaller than every prompt, prompts sharing a prefix (prefix-cache hits) and a KV
cache too small for all of them at once (preemptions). The greedy tokens of 8 prompts x 48 equal
transformers' generate, up to near-ties; with every layer sliding, the blocks behind the window
are given back (read from the stats key) on conversations longer than 4 windows. Each family's
stack starts while the previous family is checked."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch
from family_cases import WINDOW, build, copy_tokenizer
from service_stack import ServiceStack, standard_stack
from test_e2e import NEAR_TIE
from transformers import PreTrainedModel

from rill.services.worker import families
from rill.shared.broker import free_port
from rill.shared.config import ModelConfig

FAMILY_NAMES = [f.name for f in families.FAMILIES]
BLOCK = 4
BUDGET = 16  # tokens per step: every prompt takes several
MAX_LEN = 128
# KV blocks: every request fits, 8 at once do not. Behind a window a request holds a few blocks
# only, so a model whose every layer slides gets the smallest cache that holds one request.
NUM_BLOCKS = {"full": 2 * MAX_LEN // BLOCK, "sliding": MAX_LEN // BLOCK}
NEW = 48
PREFIX = 24  # tokens every prompt starts with
SUFFIXES = (8, 21, 29, 13, 32, 17, 25, 11)


def windows(path: Path) -> list[int | None]:
    """Each layer's sliding window as Rill reads the checkpoint (None: full attention)."""
    cfg = json.loads((path / "config.json").read_text())
    return families.layer_windows(cfg, families.check_config(cfg))


def num_blocks(path: Path) -> int:
    return NUM_BLOCKS["full" if None in windows(path) else "sliding"]


@contextmanager
def one_thread() -> Iterator[None]:
    """transformers' small steps run faster on one thread on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@dataclass
class Served:
    path: Path
    ref: PreTrainedModel
    stack: ServiceStack


@dataclass
class Stacks:
    """One stack per family, each launched while the family before it is checked."""

    redis_url: str
    smollm2_dir: Path
    tmp: Path
    vocab: int
    served: dict[str, Served] = field(default_factory=dict)

    def _launch(self, name: str) -> None:
        path = self.tmp / name
        ref = build(name, path, self.vocab)
        copy_tokenizer(self.smollm2_dir, path)
        kv_bytes = num_blocks(path) * BLOCK * ModelConfig.from_dir(path).kv_bytes_per_token("float32")
        prefix, port = f"rillfam-{name}-{os.getpid()}-{time.time_ns() % 10**8}", free_port()
        flags = [str(path), "--redis-url", self.redis_url, "--prefix", prefix, "--port", str(port),
                 "--host", "127.0.0.1", "--dtype", "float32", "--kv-cache-memory", str(kv_bytes),
                 "--max-model-len", str(MAX_LEN), "--max-num-batched-tokens", str(BUDGET),
                 "--max-num-seqs", "8", "--block-size", str(BLOCK)]
        stack = standard_stack(self.redis_url, str(path), prefix, port, flags)
        stack.env["RILL_WORKER_THREADS"] = "1"  # a tiny model: threads would only contend
        self.served[name] = Served(path, ref, stack.launch())

    def get(self, name: str) -> Served:
        for done in [n for n in self.served if n != name]:
            self._stop(done)
        if name not in self.served:
            self._launch(name)
        after = FAMILY_NAMES.index(name) + 1
        if after < len(FAMILY_NAMES) and FAMILY_NAMES[after] not in self.served:
            self._launch(FAMILY_NAMES[after])
        served = self.served[name]
        served.stack.wait_ready(240)
        return served

    def _stop(self, name: str) -> None:
        stack = self.served.pop(name).stack
        stack.stop()
        keys = list(stack.redis.scan_iter(match=f"{stack.prefix}:*"))
        if keys:
            stack.redis.delete(*keys)

    def close(self) -> None:
        for name in list(self.served):
            self._stop(name)


@pytest.fixture(scope="module")
def stacks(redis_url: str, smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stacks]:
    vocab = ModelConfig.from_dir(smollm2_dir).vocab_size
    s = Stacks(redis_url, Path(smollm2_dir), tmp_path_factory.mktemp("families"), vocab)
    try:
        yield s
    finally:
        s.close()


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, vocab, (PREFIX,), generator=gen).tolist()
    return [shared + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in SUFFIXES]


def reference(model: PreTrainedModel, batch: list[list[int]]) -> list[list[int]]:
    """transformers' greedy generate, the prompts left-padded into one batch; no EOS stops it
    (the requests ignore EOS)."""
    model.generation_config.eos_token_id = None
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with one_thread(), torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


def assert_same_or_near_tie(model: PreTrainedModel, prompt: list[int], ours: list[int], theirs: list[int],
                            what: str) -> None:
    """Our tokens equal transformers'; where they depart, transformers' own top-2 logit gap at
    that position must be a near-tie, else it is a bug."""
    assert len(ours) == len(theirs), f"{what}: {len(ours)} tokens, transformers made {len(theirs)}"
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    if k is None:
        return
    with one_thread(), torch.inference_mode():
        logits = model(torch.tensor([prompt + theirs[:k]])).logits[0, -1].float()
    top2 = torch.topk(logits, 2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, f"{what}: output token {k} differs where transformers' top-2 gap is {gap:.3g}"


def complete_all(stack: ServiceStack, batch: list[list[int]]) -> list[list[int]]:
    """All prompts at once through /v1/completions; the generated token ids of each."""
    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            async def one(prompt: list[int]) -> dict:
                resp = await client.post("/v1/completions", json={
                    "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0, "return_tokens_as_token_ids": True})
                assert resp.status_code == 200, resp.text
                return resp.json()
            return await asyncio.gather(*[one(p) for p in batch])

    return [[int(t.removeprefix("token_id:")) for t in r["choices"][0]["logprobs"]["tokens"]]
            for r in asyncio.run(run())]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_family_served_through_the_pipeline_equals_generate(stacks: Stacks, name: str) -> None:
    served = stacks.get(name)
    batch = prompts(stacks.vocab)
    assert min(map(len, batch)) > BUDGET and min(map(len, batch)) + NEW > 4 * WINDOW
    ours = complete_all(served.stack, batch)
    theirs = reference(served.ref, batch)
    for i, (prompt, want) in enumerate(zip(batch, theirs, strict=True)):
        # A continuation stuck on a few tokens would make the comparison say little.
        assert len(set(want)) >= 8, f"{name}: prompt {i}'s reference continuation is degenerate"
        assert_same_or_near_tie(served.ref, prompt, ours[i], want, f"{name} prompt {i}")

    st = served.stack.wait_idle()
    assert st.num_free_blocks == st.num_blocks == num_blocks(served.path), "KV blocks leaked"
    assert 0 < st.max_step_tokens <= BUDGET
    assert st.prefix_cache_hits >= BLOCK, "the shared prefix was never reused"
    assert st.preemptions > 0, "the small cache never preempted a request"
    if None in windows(served.path):  # a full-attention layer reads the whole context: nothing is released
        assert st.released_blocks == 0
    else:
        # Each request's last schedule came within a few steps of its end, with everything
        # behind its window released by then.
        slack = -(-3 * BUDGET // BLOCK)
        least = sum(max(0, (len(p) + NEW - WINDOW) // BLOCK - slack) for p in batch)
        assert st.released_blocks >= least > 0, (st.released_blocks, least)
