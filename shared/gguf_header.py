"""A GGUF file's header: its scalar metadata and where each tensor's bytes are, read without
parsing the rest (gguf's own reader builds every field, a 262k-token vocabulary included, which
took ~20 s for Gemma 3). Torch-free: the launcher's checks use it too."""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    qtype: int  # ggml type id
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length
    offset: int  # bytes from the file's start


@dataclass(frozen=True)
class Header:
    metadata: dict[str, object]  # scalar and string fields only (arrays are skipped)
    tensors: dict[str, TensorInfo]


class _Cursor:
    def __init__(self, buf: bytes | memoryview) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str) -> object:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = int(self.take("Q"))  # type: ignore[call-overload]
        self.at += n
        return bytes(self.buf[self.at - n:self.at]).decode("utf-8", "replace")

    def value(self, kind: int) -> object:
        """The value of one field; None for an array (skipped)."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = int(self.take("I")), int(self.take("Q"))  # type: ignore[call-overload]
            if item in _SCALARS:
                self.at += struct.calcsize(_SCALARS[item]) * count
            else:
                for _ in range(count):
                    self.value(item)
            return None
        return self.take(_SCALARS[kind])


def read_header(path: Path) -> Header:
    """The metadata and tensor table of a GGUF (version 2 or later), read once per version of
    the file (the model's family check and the worker's block reader both want it)."""
    st = Path(path).resolve().stat()
    return _read_header(Path(path).resolve(), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_header(path: Path, _size: int, _mtime_ns: int) -> Header:
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        cur = _Cursor(memoryview(mm))
        try:
            if bytes(mm[:4]) != b"GGUF" or struct.unpack_from("<I", mm, 4)[0] < 2:
                raise ValueError(f"{path} is not a GGUF file (version 2 or later)")
            cur.at = 8
            n_tensors, n_fields = int(cur.take("Q")), int(cur.take("Q"))  # type: ignore[call-overload]
            metadata: dict[str, object] = {}
            for _ in range(n_fields):
                key = cur.string()
                value = cur.value(int(cur.take("I")))  # type: ignore[call-overload]
                if value is not None:
                    metadata[key] = value
            infos = []
            for _ in range(n_tensors):
                name = cur.string()
                dims = tuple(int(cur.take("Q")) for _ in range(int(cur.take("I"))))  # type: ignore[call-overload]
                infos.append((name, int(cur.take("I")), dims, int(cur.take("Q"))))  # type: ignore[call-overload]
            align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))  # type: ignore[call-overload]
            start = -(-cur.at // align) * align
        finally:
            cur.buf = b""  # release the view before the map closes
    return Header(metadata, {n: TensorInfo(q, d, start + off) for n, q, d, off in infos})
