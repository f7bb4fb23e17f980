"""Tensor-parallel model runs shared by tests/test_tensor_parallel.py and scripts/gpu_check.py:
`steps` runs a chunked prefill of two sequences and a decode step through a LlamaModel; run as a
script, it is one rank of a group (gloo on cpu, NCCL on cuda) that runs `steps` on each model
folder given (`triton:` before a folder: through the Triton kernels, interpreted on CPU) and
saves rank 0's logits (and, for Triton runs, those of a decode step through DecodeGraphs); on cuda it also times an all-reduce of a decode step's activations.

    python tests/tp_case.py RANK SIZE ADDRESS OUT_DIR DEVICE MODEL_DIR...
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from rill.kernels.ops import make_attention_metadata

BLOCK = 4
TABLES = [[3, 1, 7], [0, 9, 2, 5]]  # the two sequences' KV blocks


def prompts_of(vocab: int) -> list[list[int]]:
    return [[(7 * i + 3) % vocab for i in range(8)], [(11 * i + 5) % vocab for i in range(13)]]


def steps(model) -> torch.Tensor:
    """Logits [rows, vocab] of: a 7- and a 12-token prompt prefilled in two chunks each (the
    second chunk reading the first's KV from the cache), then one decode step of both."""
    caches = model.allocate_kv_cache(16, BLOCK)
    dev = model.device
    prompts, tables = prompts_of(model.cfg.vocab_size), TABLES
    done = [0, 0]
    out = []
    with torch.inference_mode():
        for chunk in ([3, 5], [4, 7], [1, 1]):
            ids = [t for p, d, n in zip(prompts, done, chunk, strict=True) for t in p[d:d + n]]
            positions, meta = make_attention_metadata(tables, done, chunk, BLOCK, dev)
            last = torch.tensor([meta.query_start_loc_host[1] - 1, meta.query_start_loc_host[2] - 1], device=dev)
            hidden = model.final_hidden(torch.tensor(ids, device=dev), positions, meta, caches, last)
            out.append(model.logits(hidden))
            done = [d + n for d, n in zip(done, chunk, strict=True)]
    return torch.cat(out)


def graph_decode(model) -> torch.Tensor:
    """Logits [2, vocab] (rank 0; [2, 0] on the others) of the same two prompts' last tokens as
    `steps`' last rows, decoded through DecodeGraphs' padded step (2 lanes padded to 4): on CPU
    it runs eagerly the forward a CUDA graph captures, then the gather; on CUDA from the graphs."""
    from rill.services.worker.cuda_graphs import DecodeGraphs

    caches = model.allocate_kv_cache(16, BLOCK)
    dev = model.device
    prompts, tables = prompts_of(model.cfg.vocab_size), TABLES
    with torch.inference_mode():
        lens = [len(p) - 1 for p in prompts]
        positions, meta = make_attention_metadata(tables, [0, 0], lens, BLOCK, dev)
        ids = torch.tensor([t for p, n in zip(prompts, lens, strict=True) for t in p[:n]], device=dev)
        model.final_hidden(ids, positions, meta, caches, torch.tensor([0], device=dev))
    graphs = DecodeGraphs(model, caches, BLOCK, max_model_len=64, sizes=[1, 4])
    if dev.type == "cuda":  # every rank captures, the layers' all-reduces inside the graphs
        graphs.capture()
    return graphs.run([p[-1] for p in prompts], lens, tables).clone()


def main(argv: list[str]) -> None:
    from rill.kernels import ops
    from rill.services.worker.llama import LlamaModel
    from rill.services.worker.tensor_parallel import TPGroup

    rank, size, address, out, device = int(argv[0]), int(argv[1]), argv[2], Path(argv[3]), argv[4]
    torch.set_num_threads(1)
    group = TPGroup.join(rank, size, address, device, timeout_s=60)
    for i, model_dir in enumerate(argv[5:]):
        triton = model_dir.startswith("triton:")
        ops.set_backend("triton" if triton else None)
        model = LlamaModel.load(model_dir.removeprefix("triton:"), torch.float32, device=device, tp=group)
        logits = steps(model)
        graphed = graph_decode(model) if triton else None
        if rank == 0:
            torch.save(logits.cpu(), out / f"logits-{i}.pt")
            if graphed is not None:
                torch.save(graphed.cpu(), out / f"graph-{i}.pt")
    if device == "cuda":  # one decode step's activations of a Llama-3-8B at batch 32
        import time

        x = torch.randn(32, 4096, dtype=torch.bfloat16, device="cuda")
        for _ in range(10):
            group.all_reduce(x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(100):
            group.all_reduce(x)
        torch.cuda.synchronize()
        if rank == 0:
            (out / "allreduce_us.txt").write_text(f"{(time.perf_counter() - start) / 100 * 1e6:.1f}")
    group.close()


if __name__ == "__main__":
    main(sys.argv[1:])
