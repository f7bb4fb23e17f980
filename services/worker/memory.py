"""What a worker's weights hold and what its process keeps resident (the start-up log, bench_tp)."""

from __future__ import annotations

import os
from typing import Any

import torch


def held_bytes(*objs: Any) -> int:
    """Bytes of every tensor reachable from `objs` through attributes, lists, tuples and dicts,
    each storage counted once (a tied head and its embedding sharing blocks count them once)."""
    storages: set[int] = set()
    visited: set[int] = set()
    total = 0

    def add(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
            except NotImplementedError:  # opaque (e.g. oneDNN-packed): no storage to share
                key, nbytes = id(obj), obj.numel() * obj.element_size()
            if obj.numel() and key not in storages:
                storages.add(key)
                total += nbytes
            return
        if id(obj) in visited or isinstance(obj, str | bytes | int | float | bool | type(None)):
            return
        visited.add(id(obj))
        if isinstance(obj, list | tuple):
            items: Any = obj
        elif isinstance(obj, dict):
            items = obj.values()
        elif hasattr(obj, "__dict__"):
            items = vars(obj).values()
        else:
            return
        for v in items:
            add(v)

    for obj in objs:
        add(obj)
    return total


def weight_bytes(model: Any) -> int:
    """Bytes of the weights a model holds: embedding, layers and head, prepared copies and
    quantized blocks included."""
    return held_bytes(model.embed, model.embed_lookup, model.norm, model.lm_head, *model.layers)


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
