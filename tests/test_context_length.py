"""The context an engine serves against its KV cache, and a configuration refused at start."""

from __future__ import annotations

import sys
import time

import pytest

from rill.services.supervisor import Child, Supervisor
from rill.shared.config import fitted_max_model_len
from rill.shared.lifecycle import EXIT_CONFIG


def test_the_models_context_is_fitted_to_the_cache_and_an_asked_one_is_refused() -> None:
    assert fitted_max_model_len(8192, 1088, fit=True) == 1088  # the model's: lowered
    assert fitted_max_model_len(512, 1088, fit=True) == 512
    assert fitted_max_model_len(1088, 1088, fit=False) == 1088  # asked for, and held
    with pytest.raises(ValueError, match=r"--max-model-len 4096 .* holds 1088: lower --max-model-len to at most 1088"):
        fitted_max_model_len(4096, 1088, fit=False)


def _child(name: str, code: str) -> Child:
    return Child(name, "worker", [sys.executable, "-c", code])


def test_a_child_refusing_its_configuration_ends_the_server_without_a_restart() -> None:
    sup = Supervisor([_child("worker", f"raise SystemExit({EXIT_CONFIG})"), _child("gateway", "import time; time.sleep(60)")])
    sup.start()
    started = time.monotonic()
    try:
        assert sup.wait() == EXIT_CONFIG
        assert time.monotonic() - started < 20
        worker = sup.children[0]
        assert worker.restarts == 0 and worker.proc is None
        assert sup.poll() is False and worker.proc is None  # a later poll (serve's) starts nothing
    finally:
        sup.stop(timeout=2)


def test_a_child_dying_too_often_ends_the_server_for_every_later_poll() -> None:
    # `rill serve` polls while it waits for "ready", then in wait(): the second must not restart it.
    sup = Supervisor([_child("worker", "raise SystemExit(1)")], max_restarts=1)
    sup.start()
    deadline = time.monotonic() + 30
    try:
        while sup.poll():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert sup.exit_code == 1
        for _ in range(3):
            assert sup.poll() is False
            time.sleep(0.6)  # past any restart backoff
        assert sup.children[0].proc is None
    finally:
        sup.stop(timeout=2)
