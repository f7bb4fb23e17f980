"""What tensor parallelism can shard, checked without torch (the launcher and every replica run
this check before any process starts; tensor_parallel.py does the sharding)."""

from __future__ import annotations

# The families whose weights `ShardedCheckpoint` knows how to slice; any other (a MoE family,
# say) is refused with TP > 1 rather than served wrong.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")


class TensorParallelError(RuntimeError):
    """A model or setting tensor parallelism cannot serve, or a group that did not form."""


def check_supported(family: str, quantization: str, size: int, smoothed: bool = False) -> None:
    """Refuse, by name, what TP > 1 does not shard."""
    if size <= 1:
        return
    if smoothed:
        raise TensorParallelError("SmoothQuant smoothing with --tensor-parallel-size > 1 is not supported")
    if family not in FAMILIES:
        raise TensorParallelError(f"tensor parallelism does not support the {family} family "
                                  f"(supported: {', '.join(FAMILIES)})")
    why = {"int8": "SmoothQuant calibrates the whole model in one process",
           "gguf": "the GGUF blocks are not sharded; serve the .gguf with --quantization none"}
    if quantization not in ("none", "auto"):
        raise TensorParallelError(f"--quantization {quantization} with --tensor-parallel-size {size} is not "
                                  f"supported ({why.get(quantization, 'not sharded')})")
