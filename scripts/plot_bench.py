"""Two charts from `rill bench serve --save-result` files: output tok/s against concurrency and TTFT
p50 against concurrency, one line per system.

Each file is one run of one system at one concurrency. The system is the file's `label` (`rill
bench serve --label NAME`; default there: the server's host:port), else the file's name; the
concurrency is its `max_concurrency`, else `num_prompts` (a run with every request sent at once).
Lines and legend follow the order systems first appear in the files given; repeated runs of one
system at one concurrency are averaged.

    .venv/bin/python scripts/plot_bench.py runs/rill-*.json runs/llama-*.json --out-dir scripts/plots \\
        [--title "SmolLM2-135M, 2-core AMD EPYC"]

Writes OUT_DIR/output_throughput.png and OUT_DIR/ttft_p50.png; a file without the fields it needs
is refused, naming the file and the fields.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

CHARTS = (  # file name, title, y-axis label, how to read the figure from a saved result
    ("output_throughput.png", "Output throughput (higher is better)", "output tokens / s",
     lambda r: r["output_throughput"]),
    ("ttft_p50.png", "Time to first token, median (lower is better)", "TTFT p50 (ms)",
     lambda r: r["ttft_ms"]["median"]),
)


class BadResult(ValueError):
    pass


def read_result(path: Path) -> tuple[str, int, dict]:
    """(system, concurrency, result) of one --save-result file; BadResult says what is wrong."""
    try:
        r = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadResult(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(r, dict):
        raise BadResult(f"{path}: not a `rill bench serve --save-result` file (a JSON object is expected)")
    missing = [f for f in ("output_throughput", "num_prompts") if not isinstance(r.get(f), (int, float))]
    if not isinstance(r.get("ttft_ms"), dict) or not isinstance(r["ttft_ms"].get("median"), (int, float)):
        missing.append("ttft_ms.median")
    if missing:
        raise BadResult(f"{path}: not a `rill bench serve --save-result` file: missing {', '.join(missing)}")
    if not r.get("completed"):
        raise BadResult(f"{path}: no request completed in this run ({r.get('errors') or 'no errors recorded'})")
    return str(r.get("label") or path.stem), int(r.get("max_concurrency") or r["num_prompts"]), r


def collect(paths: list[Path]) -> dict[str, dict[int, list[dict]]]:
    """system → concurrency → results, systems in the order their first file came."""
    runs: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for path in paths:
        system, concurrency, result = read_result(path)
        runs[system][concurrency].append(result)
    return runs


def plot(runs: dict[str, dict[int, list[dict]]], out_dir: Path, title: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    out_dir.mkdir(parents=True, exist_ok=True)
    levels = sorted({c for per in runs.values() for c in per})
    written = []
    for name, chart_title, ylabel, figure in CHARTS:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
        lines = {system: {c: statistics.mean(figure(r) for r in per[c]) for c in sorted(per)}
                 for system, per in runs.items()}
        top = max(y for line in lines.values() for y in line.values()) or 1
        for system, line in lines.items():
            ax.plot(list(line), list(line.values()), marker="o", linewidth=2, label=system)
            for x, y in line.items():
                # Each value above its point; where another line's point is close, the lower value
                # goes to the right and the higher to the left, so the two stay readable.
                near = [other[x] for s, other in lines.items()
                        if s != system and x in other and abs(other[x] - y) < 0.08 * top]
                side = 0 if not near else (1 if y <= min(near) else -1)
                ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(6 * side, 6),
                            ha={0: "center", 1: "left", -1: "right"}[side], fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.margins(y=0.15)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_title(chart_title + (f"\n{title}" if title else ""), fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="`rill bench serve --save-result` JSON files")
    p.add_argument("--out-dir", type=Path, default=Path("."), help="where the two PNG files go")
    p.add_argument("--title", default="", help="a second title line: model, machine")
    args = p.parse_args(argv)
    try:
        runs = collect(args.results)
    except BadResult as exc:
        sys.exit(f"plot_bench: {exc}")
    for path in plot(runs, args.out_dir, args.title):
        print(path)


if __name__ == "__main__":
    main()
