"""Tensor-parallel model runs shared by the tests and scripts/bench_tp.py: `steps` runs a chunked
prefill of two sequences and a decode step through a LlamaModel; run as a script, it is one rank
of a gloo group that runs `steps` on each model folder given and saves rank 0's logits.

    python tests/tp_case.py RANK SIZE ADDRESS OUT_DIR MODEL_DIR...
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from rill.kernels.ops import make_attention_metadata

BLOCK = 4


def steps(model) -> torch.Tensor:
    """Logits [rows, vocab] of: a 7- and a 12-token prompt prefilled in two chunks each (the
    second chunk reading the first's KV from the cache), then one decode step of both."""
    caches = model.allocate_kv_cache(16, BLOCK)
    vocab = model.cfg.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(8)], [(11 * i + 5) % vocab for i in range(13)]]
    tables = [[3, 1, 7], [0, 9, 2, 5]]
    done = [0, 0]
    out = []
    with torch.inference_mode():
        for chunk in ([3, 5], [4, 7], [1, 1]):
            ids = [t for p, d, n in zip(prompts, done, chunk, strict=True) for t in p[d:d + n]]
            positions, meta = make_attention_metadata(tables, done, chunk, BLOCK)
            last = torch.tensor([meta.query_start_loc_host[1] - 1, meta.query_start_loc_host[2] - 1])
            hidden = model.final_hidden(torch.tensor(ids), positions, meta, caches, last)
            out.append(model.logits(hidden))
            done = [d + n for d, n in zip(done, chunk, strict=True)]
    return torch.cat(out)


def main(argv: list[str]) -> None:
    from rill.services.worker.llama import LlamaModel
    from rill.services.worker.tensor_parallel import TPGroup

    rank, size, address, out = int(argv[0]), int(argv[1]), argv[2], Path(argv[3])
    torch.set_num_threads(1)
    group = TPGroup.join(rank, size, address, "cpu", timeout_s=60)
    for i, model_dir in enumerate(argv[4:]):
        logits = steps(LlamaModel.load(model_dir, torch.float32, tp=group))
        if rank == 0:
            torch.save(logits, out / f"logits-{i}.pt")
    group.close()


if __name__ == "__main__":
    main(sys.argv[1:])
