"""schemathesis against the running stack's /openapi.json: no input may earn a 5xx.

The stack is real (Redis, tokenizer, scheduler, worker, detokenizer, gateway, each its own
process) but runs a tiny randomly initialised Llama with SmolLM2's tokenizer and a 128-token
context, so every generated request finishes in milliseconds. The run is bounded (examples per
operation, no stateful phase) to stay near a minute on a 2-core machine. Afterwards the stack
must still serve a normal request, with every process alive.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import schemathesis
import torch
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.config import SchemathesisConfig
from service_stack import ServiceStack, standard_stack
from transformers import LlamaConfig, LlamaForCausalLM

from rill.services.gateway.bodies import DEFAULT_MAX_LOGPROBS
from rill.services.gateway.openapi_spec import build_spec
from rill.shared.broker import free_port

MAX_MODEL_LEN = 128
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
# Checked on every response: no 5xx, a documented status code and content type.
CONFIG = {
    "phases": {"examples": {"enabled": True}, "coverage": {"enabled": True}, "fuzzing": {"enabled": True},
               "stateful": {"enabled": False}},
    "generation": {"mode": "all", "max-examples": 30, "deterministic": True},
    "checks": {"enabled": False, "not_a_server_error": {"enabled": True},
               "status_code_conformance": {"enabled": True}, "content_type_conformance": {"enabled": True}},
    "request-timeout": 30,
}


def tiny_model(dest: Path, smollm2_dir: str) -> Path:
    """A 2-layer random Llama with SmolLM2's vocabulary, saved with SmolLM2's tokenizer files."""
    src = Path(smollm2_dir)
    vocab = LlamaConfig.from_pretrained(src).vocab_size
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def stack(redis_url: str, smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceStack]:
    model = tiny_model(tmp_path_factory.mktemp("tiny-smollm2"), smollm2_dir)
    prefix = f"rillfuzz-{free_port()}"
    port = free_port()
    flags = [str(model), "--redis-url", redis_url, "--prefix", prefix, "--port", str(port), "--host", "127.0.0.1",
             "--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-model-len", str(MAX_MODEL_LEN),
             "--max-num-batched-tokens", "512", "--max-num-seqs", "16", "--block-size", "8"]
    st = standard_stack(redis_url, str(model), prefix, port, flags).start()
    try:
        yield st
    finally:
        st.stop()
        keys = list(st.redis.scan_iter(match=f"{prefix}:*"))
        if keys:
            st.redis.delete(*keys)


# The document the gateway serves for this stack (asserted below), loaded at collection time so
# schemathesis makes one test per operation.
SPEC = build_spec("tiny", MAX_MODEL_LEN, DEFAULT_MAX_LOGPROBS)
schema = schemathesis.openapi.from_dict(SPEC, config=SchemathesisConfig.from_dict(CONFIG))


def test_served_document_is_the_fuzzed_one(stack: ServiceStack) -> None:
    with urllib.request.urlopen(f"{stack.base_url}/openapi.json", timeout=10) as resp:
        served = json.load(resp)
    assert served["paths"] == SPEC["paths"] and served["components"] == SPEC["components"]


@pytest.mark.timeout(120)
@schema.parametrize()
def test_no_input_earns_a_server_error(case: schemathesis.Case, stack: ServiceStack) -> None:
    case.call_and_validate(base_url=stack.base_url)


# Inputs a generator rarely builds: ids just outside the vocabulary, lone surrogates, numbers
# beyond int64 or float range, more samples than the engine runs at once. (status, or None: any < 500)
# {V} stands for the vocabulary size, the first id outside it.
EDGE_CASES: list[tuple[str, bytes, int | None]] = [
    ("/v1/completions", b'{"prompt": [{V}]}', 400),
    ("/v1/completions", b'{"prompt": [{V-1}], "max_tokens": 2}', 200),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"{V}": 100}}', 400),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": -100, "6": 100}, "max_tokens": 2}', 200),
    ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": [2147483647], "max_tokens": 2}', None),
    ("/v1/completions", b'{"prompt": "hi", "n": 17, "max_tokens": 1}', 400),  # > --max-num-seqs
    ("/v1/completions", b'{"prompt": "hi", "n": 3, "logprobs": 20, "echo": true, "max_tokens": 2}', None),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 9223372036854775807}', 400),
    ("/v1/completions", b'{"prompt": "hi", "seed": 99999999999999999999999}', 400),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e400}', 400),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400),
    ("/v1/completions", b'{"prompt": "\\ud800x"}', 400),
    ("/v1/completions", b'{"prompt": "\\u0000", "max_tokens": 2}', 200),
    ("/v1/completions", b'{"prompt": [0, 0], "min_tokens": 4, "max_tokens": 4, "top_k": 1, "top_p": 1e-9, '
                        b'"min_p": 1, "temperature": 2, "repetition_penalty": 100, "presence_penalty": 2}', 200),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "' + b"x" * 2000 + b'"}]}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "assistant", "content": null}], "max_tokens": 2}', None),
    ("/tokenize", b'{"prompt": ""}', 200),
    ("/detokenize", b'{"tokens": [{V}]}', 400),
    ("/detokenize", b'{"tokens": []}', 200),
    ("/v1/tokenize", b'{"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false}', 200),
    ("/v1/detokenize", b'{"tokens": [{V}]}', 400),
    # Hostile JSON, refused and unknown fields: 400 before anything reaches a service.
    ("/v1/completions", b'{"prompt": "hi", "temperature": ' + b"1" * 400 + b"}", 400),
    ("/v1/completions", b'{"prompt": "hi", "bad_words": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    ("/v1/completions", b'{"prompt": "hi", "best_of": 2}', 400),
    ("/v1/completions", b'{"prompt": "hi", "frobnicate": 1}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "custom"}]}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                             b'"tools": [{"type": "function", "function": {"name": "f"}}]}', 200),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "none", '
                             b'"response_format": {"type": "text"}, "max_tokens": 2}', 200),
]


def test_edge_cases_are_client_errors_at_worst(stack: ServiceStack, smollm2_dir: str) -> None:
    vocab = LlamaConfig.from_pretrained(smollm2_dir).vocab_size
    for path, template, expected in EDGE_CASES:
        body = template.replace(b"{V}", str(vocab).encode()).replace(b"{V-1}", str(vocab - 1).encode())
        req = urllib.request.Request(f"{stack.base_url}{path}", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status = resp.status
        except urllib.error.HTTPError as err:
            status = err.code
            assert "error" in json.loads(err.read()), (path, body)
        assert status < 500 and (expected is None or status == expected), (status, path, body[:80])


def test_stack_still_serves_after_fuzzing(stack: ServiceStack) -> None:
    assert stack.alive(), {n: p.returncode for n, p in stack.procs.items()}
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
    out = client.completions.create(model=client.models.list().data[0].id, prompt="Hello", max_tokens=5,
                                    temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage is not None and 1 <= out.usage.completion_tokens <= 5
    assert stack.wait_idle().num_running == 0
    # The real scheduler's numbers reach /metrics: every request that ran was queued once.
    with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as resp:
        samples = {s.name: s.value for fam in text_string_to_metric_families(resp.read().decode())
                   for s in fam.samples if s.labels.get("finished_reason") in (None, "length")}
    assert samples["rill:request_queue_time_seconds_count"] >= samples["rill:request_success_total"] >= 1
    assert samples["rill:num_requests_running"] == 0
    assert samples["rill:generation_tokens_total"] >= 1
