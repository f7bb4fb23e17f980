"""`rill serve` as a user runs it: embedded broker, every service a supervised child process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
import redis

from rill.services.supervisor import children_of
from rill.shared.broker import free_port
from rill.shared.model_files import resolve_model


def post(url: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def test_serve_supervises_children_and_stops_them(smollm2_dir: str) -> None:
    port = free_port()
    proc = subprocess.Popen(
        # No --host: the default must be loopback (checked on the gateway's listening socket below).
        [sys.executable, "-m", "rill.services.cli", "serve", smollm2_dir, "--port", str(port),
         "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--log-level", "INFO"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    stderr_lines: list[str] = []
    threading.Thread(target=lambda: stderr_lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    try:
        ready = proc.stdout.readline()  # blocks until serve prints its one "ready" line
        assert "ready at" in ready, "".join(stderr_lines)
        kids = children_of(proc.pid)
        names = [c.split(" service ")[1].split()[0] for c in kids.values() if " service " in c]
        assert sorted(names) == ["detokenizer", "gateway", "scheduler", "tokenizer", "worker"]
        assert any("valkey-server" in c for c in kids.values()), "embedded broker not started"
        # The embedded broker wants a password, handed to the children in their environment and
        # on no command line (every local user can list those).
        title = next(c for c in kids.values() if "valkey-server" in c)  # retitled "valkey-server HOST:PORT"
        broker_port = int(re.search(r"127\.0\.0\.1:(\d+)", title).group(1))
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=broker_port).ping()
        service = next(p for p, c in kids.items() if " service " in c)
        environ = Path(f"/proc/{service}/environ").read_text().split("\0")
        env = dict(kv.split("=", 1) for kv in environ if "=" in kv)
        password = urlsplit(env["RILL_REDIS_URL"]).password
        assert password and len(password) >= 16 and redis.Redis(port=broker_port, password=password).ping()
        assert not any(password in c for c in kids.values())
        gateway = next(p for p, c in kids.items() if " service gateway " in c)
        listening = [c.laddr for c in psutil.Process(gateway).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
        # The KV sizing line uses the formula from the design: layers x tokens x 2 x kv_heads x head_dim x bytes.
        assert any("30 layers x" in line and "kv_heads" in line for line in stderr_lines)

        base = f"http://127.0.0.1:{port}"
        first = post(f"{base}/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0})
        assert first["usage"]["completion_tokens"] == 5
        # A normal start warns of nothing (the gateway waiting for the engine's first beat is no fault).
        assert not [line for line in stderr_lines if "level=warning" in line or "level=error" in line]

        # A dead child is reported and replaced; the server keeps serving.
        tok_pid = next(p for p, c in kids.items() if " service tokenizer " in c)
        os.kill(tok_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not any("tokenizer-0 exited" in line for line in stderr_lines):
            assert time.monotonic() < deadline, "dead tokenizer was not reported"
            time.sleep(0.2)
        again = post(f"{base}/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0},
                     timeout=120)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]

        # So is a dead scheduler: the request it held ends with a clear error, the next one is served.
        sched_pid = next(p for p, c in children_of(proc.pid).items() if " service scheduler " in c)
        body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        error, killed_at = None, 0.0
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                error = json.loads(line[6:]).get("error", {}).get("message", error)
                if not killed_at:
                    os.kill(sched_pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        assert error is not None and "engine is not available" in error, error
        assert time.monotonic() - killed_at < 10
        again = post(f"{base}/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0},
                     timeout=120)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert proc.poll() is None
        kids = children_of(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("rill serve did not stop on SIGTERM")
    assert code == 0
    time.sleep(0.5)
    alive = [p for p in kids if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]]
    assert not alive, f"children left running after SIGTERM: {alive}"


def test_resolve_model_accepts_folders_and_gguf(tmp_path: Path, smollm2_dir: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "tiny"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(folder)
    assert resolve_model(str(folder)) == folder.resolve()

    from rill.shared.model_files import default_gguf

    gguf = default_gguf()
    assert resolve_model(str(gguf)) == Path(smollm2_dir)  # converted once, then cached
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path / "missing"))


def _serve(model: str, port: int, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "rill.services.cli", "serve", model, "--port", str(port),
                             "--dtype", "float32", "--kv-cache-memory", "24MiB", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_a_context_the_kv_cache_cannot_hold_is_fitted_or_refused_at_start(smollm2_dir: str) -> None:
    from rill.shared.config import ModelConfig, kv_cache_blocks
    from rill.shared.lifecycle import EXIT_CONFIG

    held = kv_cache_blocks(ModelConfig.from_dir(smollm2_dir), "float32", 16, 24 << 20) * 16  # well under 8192
    # Asked for: refused at start, in one line naming both lengths, and not restarted.
    proc = _serve(smollm2_dir, free_port(), "--max-model-len", "4096")
    try:
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_CONFIG, err[-2000:]
    assert f"--max-model-len 4096 needs 4096 tokens of KV cache but the cache holds {held}" in err
    assert err.count("rill: service worker exited with code") == 1, err[-2000:]

    # The model's own (8192): lowered to what the cache holds, and chat's default max_tokens with it.
    port = free_port()
    proc = _serve(smollm2_dir, port)
    try:
        assert "ready at" in proc.stdout.readline()
        base = f"http://127.0.0.1:{port}/v1"
        with urllib.request.urlopen(f"{base}/models", timeout=30) as resp:
            assert json.loads(resp.read())["data"][0]["max_model_len"] == held
        assert post(f"http://127.0.0.1:{port}/tokenize", {"prompt": "hi"})["max_model_len"] == held
        chat = {"messages": [{"role": "user", "content": "Count: " + " ".join(str(i) for i in range(150))}],
                "temperature": 0, "ignore_eos": True}
        out = post(f"{base}/chat/completions", chat, timeout=300)
        assert out["usage"]["total_tokens"] == held and out["choices"][0]["finish_reason"] == "length"
        chat["messages"][0]["content"] = "word " * held
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(f"{base}/chat/completions", chat)
        error = json.loads(refused.value.read())["error"]
        assert refused.value.code == 400 and error["param"] == "messages"
        assert f"maximum context length is {held} tokens" in error["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert f"max_model_len 8192 (the model's) lowered to {held}" in err
