"""`rill serve`: the whole stack as supervised child processes (each `rill service NAME`), an
embedded broker when none is given, and one line once it serves."""

from __future__ import annotations

import argparse
import secrets
import sys
import time
import urllib.request
import uuid

from rill.services.cli import (
    engine_args,
    resolve_checked,
)
from rill.services.supervisor import Child
from rill.shared import envs
from rill.shared.logs import setup_logging


def _child_argv(ns: argparse.Namespace, name: str, model_dir: str, replica: str) -> list[str]:
    # No --redis-url: the children take it from $RILL_REDIS_URL (serve sets it), since a URL may
    # hold the broker's password and every process listing shows command lines.
    argv = [sys.executable, "-m", "rill.services.cli", "service", name, model_dir,
            "--prefix", ns.prefix, "--replica-name", replica, "--max-num-seqs", str(ns.max_num_seqs),
            "--block-size", str(ns.block_size),
            "--gpu-memory-utilization", str(ns.gpu_memory_utilization), "--dtype", ns.dtype,
            "--quantization", ns.quantization,
            "--device", ns.device, "--engine-id", str(ns.engine_id), "--seed", str(ns.seed),
            "--tensor-parallel-size", str(ns.tensor_parallel_size),
            "--host", ns.host, "--port", str(ns.port),
            "--long-prefill-token-threshold", str(ns.long_prefill_token_threshold),
            "--scheduling-policy", ns.scheduling_policy, "--max-logprobs", str(ns.max_logprobs),
            "--max-request-body-bytes", str(ns.max_request_body_bytes),
            "--enable-prefix-caching" if ns.enable_prefix_caching else "--no-enable-prefix-caching",
            "--async-scheduling" if ns.async_scheduling else "--no-async-scheduling"]
    for flag, value in (("--max-model-len", ns.max_model_len), ("--kv-cache-memory", ns.kv_cache_memory),
                        ("--max-num-batched-tokens", ns.max_num_batched_tokens),
                        ("--served-model-name", ns.served_model_name), ("--log-level", ns.log_level),
                        ("--speculative-config", ns.speculative_config)):
        if value is not None:
            argv += [flag, str(value)]
    if name in ("tokenizer", "gateway") and ns.chat_template:  # the gateway reads its tool-call format
        argv += ["--chat-template", ns.chat_template]
    if name == "tokenizer":
        argv += ["--routing", ns.routing]
    if name == "tokenizer" and ns.trust_request_chat_template:
        argv.append("--trust-request-chat-template")
    if name == "gateway":
        argv += ["--tool-call-parser", ns.tool_call_parser, "--reasoning-parser", ns.reasoning_parser]
    if name == "gateway" and ns.ignore_unknown_fields:
        argv.append("--ignore-unknown-fields")
    if name == "gateway" and ns.allowed_origins:
        argv += ["--allowed-origins", ns.allowed_origins]
    if name == "gateway":
        from rill.services.gateway.limit_flags import limit_argv

        argv += limit_argv(ns)
    return argv


def build_children(ns: argparse.Namespace, model_dir: str) -> list[Child]:
    """Every service process of one server. Gateway replicas share --port through SO_REUSEPORT:
    one address for clients, the kernel spreads connections, and each replica keeps its own
    reply stream (a connection, hence a stream or socket, stays on the replica that accepted it)."""
    for flag in ("tokenizer_replicas", "detokenizer_replicas", "gateway_replicas"):
        if getattr(ns, flag) < 1:
            raise SystemExit(f"rill: --{flag.replace('_', '-')} must be at least 1")
    tag = uuid.uuid4().hex[:6]
    children = engine_children(ns, model_dir, tag)
    for kind, count in (("tokenizer", ns.tokenizer_replicas), ("detokenizer", ns.detokenizer_replicas)):
        for i in range(count):
            children.append(Child(f"{kind}-{i}", kind, _child_argv(ns, kind, model_dir, f"{kind}-{tag}-{i}")))
    shared = ["--reuse-port"] if ns.gateway_replicas > 1 else []
    for i in range(ns.gateway_replicas):
        name = "gateway" if ns.gateway_replicas == 1 else f"gateway-{i}"
        children.append(Child(name, "gateway", _child_argv(ns, "gateway", model_dir, f"gateway-{tag}-{i}")
                              + shared))
    return children


def engine_roles(ns: argparse.Namespace) -> list[tuple[int, str]]:
    """(engine id, role) of every engine `rill serve` starts: one colocated engine (--engine-id),
    --data-parallel-size colocated engines 0..N-1, or --prefill-engines prefill engines 0..N-1
    then --decode-engines decode engines N..N+M-1."""
    n, m = getattr(ns, "prefill_engines", 0), getattr(ns, "decode_engines", 0)
    dp = getattr(ns, "data_parallel_size", 1)
    if n < 0 or m < 0 or (n == 0) != (m == 0):
        raise SystemExit("rill: --prefill-engines and --decode-engines go together, each at least 1 "
                         "(both 0: one colocated engine)")
    if dp < 1 or (dp > 1 and (n or ns.tensor_parallel_size > 1)):
        raise SystemExit("rill: --data-parallel-size must be at least 1, and above 1 only without "
                         "prefill/decode engines and tensor parallelism")
    if dp > 1:
        return [(e, "both") for e in range(dp)]
    if n == 0:
        return [(ns.engine_id, "both")]
    return [(e, "prefill") for e in range(n)] + [(n + e, "decode") for e in range(m)]


def worker_ranks(ns: argparse.Namespace, model_dir: str, tag: str) -> list[Child]:
    """The colocated engine's worker, or its --tensor-parallel-size ranks: one restart group (a
    dead rank takes the others down, and they start again together)."""
    n = ns.tensor_parallel_size
    if n == 1:
        return [Child("worker", "worker", _child_argv(ns, "worker", model_dir, f"worker-{tag}"))]
    if not ns.tp_address:  # a free local port for the group's rendezvous
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ns.tp_address = f"127.0.0.1:{s.getsockname()[1]}"
    return [Child(f"worker-r{r}", "worker", _child_argv(ns, "worker", model_dir, f"worker-{tag}-r{r}")
                  + ["--tp-rank", str(r), "--tp-address", ns.tp_address], group="worker") for r in range(n)]


def engine_children(ns: argparse.Namespace, model_dir: str, tag: str) -> list[Child]:
    """A worker and a scheduler per engine; a disaggregated engine's pair gets its id and role."""
    roles = engine_roles(ns)
    if len(roles) == 1 and roles[0][1] == "both":
        return [*worker_ranks(ns, model_dir, tag),
                Child("scheduler", "scheduler",
                      _child_argv(ns, "scheduler", model_dir, f"scheduler-{tag}"))]
    children: list[Child] = []
    for e, role in roles:
        for kind in ("worker", "scheduler"):
            argv = _child_argv(ns, kind, model_dir, f"{kind}-{tag}-{e}") + [
                "--engine-id", str(e), "--role", role]  # argparse: the last --engine-id wins
            children.append(Child(f"{kind}-{e}-{role}", kind, argv))
    return children


def serve(ns: argparse.Namespace) -> int:
    from rill.services.supervisor import Supervisor
    from rill.shared.broker import EmbeddedBroker

    setup_logging("serve", ns.log_level)
    model_dir = resolve_checked(ns.model)  # converts a GGUF once, with a progress bar
    engine_args(ns, model_dir)  # validate flags before starting anything
    engine_roles(ns)
    broker = None
    redis_url = ns.redis_url
    if not redis_url:
        # Its own password, so that no other local user can read prompts or inject messages.
        broker = EmbeddedBroker(password=secrets.token_urlsafe(24), maxmemory=ns.broker_maxmemory).start()
        redis_url = broker.url
    envs.export("RILL_REDIS_URL", redis_url)  # the children's, off their command lines
    if ns.api_key is not None:
        # The gateways inherit the key through the environment: on their command lines it would
        # show in every process listing.
        envs.export("RILL_API_KEY", ns.api_key)
    # Children run `python -m rill.services.cli` in our working directory: keep it off their
    # sys.path, where a checkout's kernels/ folder would shadow the `kernels` package transformers imports.
    envs.export("PYTHONSAFEPATH", "1")
    if ns.data_parallel_size > 1 and ns.device != "cuda":
        # Engines on one CPU split its cores: each worker using all of them would oversubscribe.
        import os

        envs.export("RILL_WORKER_THREADS", str(max(1, len(os.sched_getaffinity(0)) // ns.data_parallel_size)),
                    overwrite=False)
    sup = Supervisor(build_children(ns, model_dir), drain_s=ns.shutdown_timeout)
    sup.start()
    try:
        _announce_when_ready(ns, sup, redis_url)
        return sup.wait()
    finally:
        sup.stop()
        if broker is not None:
            broker.stop()


def _announce_when_ready(ns: argparse.Namespace, sup: object, redis_url: str, timeout: float = 600.0) -> None:
    """Print one line when the gateway answers and the engine has published its first stats."""
    import redis

    from rill.shared.bus import connect
    from rill.shared.streams import Streams

    host = "127.0.0.1" if ns.host in ("0.0.0.0", "::") else ns.host
    url = f"http://{host}:{ns.port}"
    client = connect(redis_url)
    stats_keys = [Streams(ns.prefix).stats_key(e) for e, _ in engine_roles(ns)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sup.poll():  # type: ignore[attr-defined]
            return
        try:
            if client.exists(*stats_keys) < len(stats_keys):
                time.sleep(0.5)
                continue
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                if resp.status == 200:
                    print(f"rill: ready at {url} (OpenAI API at {url}/v1, WebSocket at {url.replace('http', 'ws')}/v1/ws)",
                          flush=True)
                    return
        except (OSError, redis.RedisError):
            pass
        time.sleep(0.5)
