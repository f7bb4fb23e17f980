"""A GGUF's Q4_1 tensors requantized to another 32-element format with gguf-py (metadata and every
other tensor copied): a real model in a format no wheel here ships (tests of Q4_0's kernels)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.constants import GGUFValueType

_ADD = {GGUFValueType.STRING: "add_string", GGUFValueType.BOOL: "add_bool", GGUFValueType.FLOAT32: "add_float32",
        GGUFValueType.UINT32: "add_uint32", GGUFValueType.INT32: "add_int32", GGUFValueType.UINT64: "add_uint64",
        GGUFValueType.ARRAY: "add_array"}


def requantize(src: Path, dst: Path, to: GGMLQuantizationType) -> Path:
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        getattr(writer, _ADD[field.types[0]])(name, field.contents())
    for t in reader.tensors:
        if t.tensor_type == GGMLQuantizationType.Q4_1:
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            writer.add_tensor(t.name, gguf.quants.quantize(values, to), raw_dtype=to)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
