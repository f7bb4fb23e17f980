"""compose.yaml: its shape (one image, `rill service NAME` per service, health-gated start,
scalable stateless stages, a GPU override), then its exact commands run as local processes
against the test Redis (no Docker engine here), with the stateless stages scaled to two."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from service_stack import ServiceStack, count_chats, rill_executable

from rill.services.cli import SERVICES, build_parser
from rill.shared.broker import free_port
from rill.shared.streams import DETOKENIZER_GROUP, TOKENIZER_GROUP

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
GPU_OVERRIDE = ROOT / "scripts" / "compose.gpu.yaml"
STATELESS = ("tokenizer", "detokenizer")
VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${NAME} / ${NAME:-default} substitution."""
    return VARIABLE.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())  # anchors and `<<` merges resolve here, as in compose


def dockerfile() -> str:
    spec = load(COMPOSE)["services"]["worker"]["build"]
    path = ROOT / spec.get("context", ".") / spec["dockerfile"]
    assert path.is_file(), path
    return path.read_text()


def command(service: dict[str, Any], env: dict[str, str]) -> list[str]:
    cmd = service["command"]
    assert isinstance(cmd, list), "use the exec (list) form, so no shell sits between Docker and rill"
    return [interpolate(str(a), env) for a in cmd]


def test_compose_file_describes_the_stack() -> None:
    spec = load(COMPOSE)
    services = spec["services"]
    assert set(services) == {"redis", *SERVICES}

    redis_svc = services["redis"]
    assert redis_svc["image"].split(":")[0] == "redis"
    assert "ping" in " ".join(redis_svc["healthcheck"]["test"])

    entrypoint = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", dockerfile(), re.M)
    assert entrypoint and json.loads(entrypoint.group(1)) == ["rill"]
    assert re.search(r"^ARG TORCH_VARIANT=cpu$", dockerfile(), re.M), "the image is CPU by default"
    model_volumes = set(spec["volumes"])
    images = set()
    for name in SERVICES:
        svc = services[name]
        images.add((svc["image"], svc["build"]["dockerfile"]))
        assert "entrypoint" not in svc
        ns = build_parser().parse_args(command(svc, {}))  # exactly what the container runs after `rill`
        assert (ns.command, ns.name) == ("service", name)
        assert urlsplit(ns.redis_url).hostname == "redis"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert svc["restart"] in ("always", "unless-stopped", "on-failure")
        mounts = {v.split(":")[0]: v.split(":")[1] for v in svc["volumes"]}
        assert any(src in model_volumes and dst == "/models" for src, dst in mounts.items()), mounts
    assert len(images) == 1, f"one image for every service: {images}"
    assert "RILL_CACHE_DIR=/models" in dockerfile(), "converted models are cached in the volume"

    for name in STATELESS:  # replicas: nothing that two containers could not share
        assert "container_name" not in services[name] and "ports" not in services[name]
    gateway = services["gateway"]
    assert any(str(p).endswith(":8000") for p in gateway["ports"])
    assert build_parser().parse_args(command(gateway, {})).port == 8000
    assert "/health" in " ".join(gateway["healthcheck"]["test"])

    # The worker can reserve a GPU through the override file, in a CUDA build of the same image.
    gpu = load(GPU_OVERRIDE)["services"]["worker"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)
    assert gpu["build"]["args"]["TORCH_VARIANT"] != "cpu"
    ns = build_parser().parse_args(command(gpu, {}))
    assert (ns.command, ns.name, ns.device) == ("service", "worker", "cuda")


def local_argv(cmd: list[str], redis_url: str, prefix: str, port: int) -> list[str]:
    """The compose command with the broker, key prefix and port of this test (and fast CPU settings)."""
    argv = list(cmd)
    argv[argv.index("--redis-url") + 1] = redis_url
    return [*rill_executable(), *argv, "--prefix", prefix, "--port", str(port), "--host", "127.0.0.1",
            "--dtype", "float32", "--kv-cache-memory", "128MiB", "--max-model-len", "2048",
            "--max-num-batched-tokens", "256", "--max-num-seqs", "16"]


def test_compose_commands_serve_a_chat(redis_url: str, smollm2_dir: str) -> None:
    """`docker compose up --scale tokenizer=2 --scale detokenizer=2`, minus Docker."""
    services = load(COMPOSE)["services"]
    prefix = f"rillcompose-{os.getpid()}-{time.time_ns() % 10**8}"
    port = free_port()
    # No RILL_MODEL: the default model, which smollm2_dir has already converted into the cache.
    commands = {}
    for name in SERVICES:
        for i in range(2 if name in STATELESS else 1):
            commands[f"{name}-{i}"] = local_argv(command(services[name], {}), redis_url, prefix, port)
    stack = ServiceStack(redis_url, prefix, port, commands).start()
    try:
        for resp in asyncio.run(count_chats(stack.base_url)):
            assert resp.choices[0].message.content.strip()
            assert resp.usage.completion_tokens <= 6 and resp.choices[0].finish_reason in ("stop", "length")
        # Both replicas of each stateless stage joined their consumer group.
        groups = [*((stream, TOKENIZER_GROUP) for stream in stack.requests_streams()),
                  (stack.streams.detok(0), DETOKENIZER_GROUP)]
        for stream, group in groups:
            consumers = stack.redis.xinfo_consumers(stream, group)
            assert len(consumers) >= 2, consumers
        assert stack.alive()
    finally:
        stack.stop()
