"""scripts/plot_bench.py draws its two charts from `rill bench serve --save-result` files, written
here by bench_serve's own summarize + save_result from synthetic request outcomes, and refuses a
file that lacks the fields it plots."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rill.services.clients.bench_serve import Outcome, add_arguments, save_result, summarize

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "plot_bench.py"


def saved_run(tmp_path: Path, argv: list[str], ttft: float, tokens: int, duration: float) -> Path:
    """A result file as `rill bench serve ARGV --save-result FILE` writes it, for 8 requests that
    each took `ttft` s to their first token and produced `tokens` tokens."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--num-prompts", "8", "--model", "m", *argv])
    outcomes = [Outcome(ok=True, input_len=32, output_tokens=tokens, ttft=ttft, e2e=ttft + 0.01 * tokens,
                        itl=[0.01] * (tokens - 1)) for _ in range(8)]
    path = tmp_path / f"run{len(list(tmp_path.glob('run*.json')))}.json"
    save_result(summarize(args, outcomes, duration), str(path))
    return path


def plot(*argv: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, argv)], capture_output=True, text=True, timeout=120)


def test_two_charts_one_line_per_system(tmp_path: Path) -> None:
    files = []
    for system, url, speed in (("Rill", "http://127.0.0.1:8399", 2.0), (None, "http://127.0.0.1:8080", 1.0)):
        for c in (1, 4, 16):
            label = ["--label", system] if system else []  # unlabelled: the URL's host:port names the system
            files.append(saved_run(tmp_path, ["--base-url", url, "--max-concurrency", str(c), *label],
                                   ttft=0.05 * c, tokens=64, duration=8 * 64 / (speed * 40 * c)))
    assert json.loads(files[0].read_text())["label"] == "Rill"
    assert json.loads(files[-1].read_text())["label"] == "127.0.0.1:8080"
    out = tmp_path / "plots"
    proc = plot(*files, "--out-dir", out, "--title", "synthetic")
    assert proc.returncode == 0, proc.stderr
    for name in ("output_throughput.png", "ttft_p50.png"):
        png = (out / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
    assert proc.stdout.split() == [str(out / "output_throughput.png"), str(out / "ttft_p50.png")]


def test_refuses_a_file_without_the_fields_it_plots(tmp_path: Path) -> None:
    good = saved_run(tmp_path, ["--max-concurrency", "4"], ttft=0.1, tokens=16, duration=1.0)
    result = json.loads(good.read_text())
    del result["output_throughput"], result["ttft_ms"]["median"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(result))
    proc = plot(good, bad, "--out-dir", tmp_path / "plots")
    assert proc.returncode != 0
    assert f"{bad}: not a `rill bench serve --save-result` file: missing output_throughput, ttft_ms.median" in proc.stderr
    assert not (tmp_path / "plots").exists()
    notjson = tmp_path / "notes.txt"
    notjson.write_text("tok/s: 100")
    proc = plot(notjson)
    assert proc.returncode != 0 and f"{notjson}: not a readable JSON file" in proc.stderr
