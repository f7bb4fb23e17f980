"""`--dtype auto`: bf16 where its GEMMs are not clearly slower than fp32, decided once per CPU."""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rill.services.worker import dtype_choice
from rill.services.worker.dtype_choice import BF16_MIN_SPEED, cpu_prefers_bf16, measure_bf16_speed
from rill.services.worker.dtype_choice import resolve_dtype as resolve

NO_AMX = "flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
AMX = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_int8\n"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RILL_CACHE_DIR", str(tmp_path))
    return tmp_path


def counting_probe(monkeypatch, speed: float) -> list[int]:
    calls: list[int] = []

    def probe() -> float:
        calls.append(1)
        return speed

    monkeypatch.setattr(dtype_choice, "measure_bf16_speed", probe)
    monkeypatch.setattr(dtype_choice, "_mkldnn_bf16", lambda: True)
    return calls


def test_explicit_dtypes_are_kept_and_unknown_ones_refused() -> None:
    for name in ("float32", "bfloat16", "float16"):
        assert resolve(name, "cpu") == name
    with pytest.raises(ValueError, match="dtype must be"):
        resolve("int4", "cpu")
    assert resolve("auto", "cuda") == "bfloat16"


@pytest.mark.parametrize(("speed", "want"), [(0.6, False), (BF16_MIN_SPEED, True), (1.9, True)])
def test_without_amx_the_measured_speed_decides_once(cache_dir, monkeypatch, speed: float, want: bool) -> None:
    calls = counting_probe(monkeypatch, speed)
    assert cpu_prefers_bf16(NO_AMX) is want
    assert cpu_prefers_bf16(NO_AMX) is want
    assert len(calls) == 1  # the second answer came from the cache file
    (saved,) = (cache_dir / "dtype-probe").glob("*.json")
    assert json.loads(saved.read_text())["bf16_speed"] == speed


def test_amx_means_bf16_without_measuring(cache_dir, monkeypatch) -> None:
    calls = counting_probe(monkeypatch, 0.1)
    assert cpu_prefers_bf16(AMX)
    assert calls == []


def test_no_bf16_support_in_torch_means_float32(cache_dir, monkeypatch) -> None:
    calls = counting_probe(monkeypatch, 5.0)
    monkeypatch.setattr(dtype_choice, "_mkldnn_bf16", lambda: False)
    assert not cpu_prefers_bf16(AMX)
    assert calls == []


def test_a_damaged_cache_file_is_measured_again(cache_dir, monkeypatch) -> None:
    calls = counting_probe(monkeypatch, 0.5)
    assert not cpu_prefers_bf16(NO_AMX)
    (saved,) = (cache_dir / "dtype-probe").glob("*.json")
    saved.write_text("{half a fi")
    monkeypatch.setattr(dtype_choice, "measure_bf16_speed", lambda: 1.5)
    assert cpu_prefers_bf16(NO_AMX)
    assert len(calls) == 1


def test_the_real_probe_on_this_machine(cache_dir) -> None:
    speed = measure_bf16_speed(repeats=2)
    assert math.isfinite(speed) and 0.05 < speed < 50
    # auto on this machine follows its own (cached) measurement
    choice = resolve("auto", "cpu")
    if dtype_choice._mkldnn_bf16():
        assert (choice == "bfloat16") == cpu_prefers_bf16()
    else:
        assert choice == "float32"


def test_workers_starting_together_measure_once(cache_dir, monkeypatch) -> None:
    """Callers racing on a fresh cache: one measures, the others wait for and read its answer."""
    calls: list[int] = []

    def slow_probe() -> float:
        calls.append(1)
        time.sleep(0.3)
        return 0.5 + len(calls)  # a second measurement would give another answer

    monkeypatch.setattr(dtype_choice, "measure_bf16_speed", slow_probe)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: dtype_choice.bf16_speed(), range(4)))
    assert calls == [1]
    assert answers == [1.5] * 4
