"""A GGUF file's tensors, found without reading its metadata's values.

Rationale. gguf-py's GGUFReader builds a numpy view for every part of every metadata value: a
small model's tokenizer (49,152 tokens and as many merges, stored as string arrays) is 250,000
views, 5 s of an engine's start on one core, for a loader that needs two metadata values (the
architecture and the alignment) and the tensors' places.

Approach. One pass over the header (GGUF v2 and v3, little-endian, as llama.cpp writes them):
each metadata value is stepped over by its size (a string array element by element: its lengths
are inline), the two values the loader needs are kept, then the tensor infos are read and each
tensor is a view of the memory-mapped file, shaped as GGUFReader shapes it (numpy's order: the
slowest dimension first; a quantized type's last dimension in bytes), so gguf-py's `dequantize`
takes it as it takes GGUFReader's.

Limitations. Big-endian files and GGUF v1 are refused by name; every offset and count is checked
against the file's size before it is used, and a file that does not hold what it says is a
ValueError naming what is wrong.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
# metadata value types (gguf-py's GGUFValueType): fixed sizes; 8 = string, 9 = array
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
MAX_KEY = 65535  # the spec's longest key; a tensor's name or the architecture: 64 in llama.cpp, 256 here
MAX_NAME = 256
PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass
class GgufTensor:
    name: str
    type: int  # ggml's type id (gguf-py's GGMLQuantizationType)
    dims: tuple[int, ...]  # as the file lists them: the fastest dimension first
    data: np.ndarray  # a view of the mapped file, in numpy's order (bytes last for a quantized type)


@dataclass
class GgufFile:
    architecture: str
    tensors: list[GgufTensor]


def read_gguf_file(path: Path) -> GgufFile:
    try:
        return _read(path)
    except RecursionError:  # (arrays of arrays nested past Python's depth)
        raise ValueError("metadata arrays nested too deep") from None


def _read(path: Path) -> GgufFile:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    data = np.memmap(path, mode="r")
    header = _Header(memoryview(data))
    if header.take(4) != MAGIC:
        raise ValueError("no GGUF magic")
    version = header.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (2 and 3 are read; a big-endian file reads as another)")
    n_tensors, n_kv = header.unpack("<QQ")
    if 24 * n_tensors + 12 * n_kv > len(data):  # (the least a tensor's info and a value take)
        raise ValueError(f"{n_tensors} tensors and {n_kv} metadata values: more than the file's {len(data)} bytes hold")
    architecture, alignment, keys = "", 32, set()
    for _ in range(n_kv):
        key = header.string(MAX_KEY)
        if key in keys:
            raise ValueError(f"metadata key {key!r} given twice")
        keys.add(key)
        kind = header.unpack("<I")
        if key == "general.architecture" and kind == STRING:
            architecture = header.string(MAX_NAME)
        elif key == "general.alignment":
            if kind != 4:
                raise ValueError(f"general.alignment of value type {kind}, not uint32")
            alignment = header.unpack("<I")
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError(f"general.alignment {alignment} is not a power of two")
        else:
            header.skip_value(kind)
    infos = []
    for _ in range(n_tensors):
        name = header.string(MAX_NAME)
        dims = header.unpack_all(f"<{header.unpack('<I')}Q")  # (a count past the file fails there)
        infos.append((name, header.unpack("<I"), dims, header.unpack("<Q")))
    start = -(-header.offset // alignment) * alignment
    tensors, names = [], set()
    for name, kind, dims, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name!r} listed twice")
        names.add(name)
        if offset % alignment:
            raise ValueError(f"tensor {name!r}: offset {offset} is not a multiple of the alignment {alignment}")
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r}: unknown ggml type {kind}") from None
        shape = tuple(reversed(dims))
        count = int(np.prod(dims, dtype=object))
        if count % block or (dims and dims[0] % block):
            raise ValueError(f"tensor {name!r}: {dims} is not whole blocks of {block}")
        nbytes, first = count // block * size, start + offset
        if first + nbytes > len(data):
            raise ValueError(f"tensor {name!r}: bytes {first}..{first + nbytes} past the file's end ({len(data)})")
        raw = data[first:first + nbytes]
        if kind in PLAIN:
            view = raw.view(PLAIN[kind]).reshape(shape)
        else:
            view = raw.reshape(*shape[:-1], shape[-1] // block * size)
        tensors.append(GgufTensor(name, kind, dims, view))
    return GgufFile(architecture, tensors)


class _Header:
    """A cursor over the header's bytes: every read checked against the end."""

    def __init__(self, buffer: memoryview):
        self.buffer, self.offset = buffer, 0

    def need(self, n: int) -> None:
        """ValueError unless n more bytes are there."""
        if n < 0 or self.offset + n > len(self.buffer):
            raise ValueError(f"the header runs past the file's end (at byte {self.offset}, {n} more)")

    def take(self, n: int) -> bytes:
        self.need(n)
        out = bytes(self.buffer[self.offset:self.offset + n])
        self.offset += n
        return out

    def unpack_all(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        self.need(size)
        values = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += size
        return values

    def unpack(self, fmt: str):
        values = self.unpack_all(fmt)
        return values[0] if len(values) == 1 else values

    def string(self, limit: int) -> str:
        """A string of at most `limit` bytes, read; a longer one is refused before it is read."""
        n = self.unpack("<Q")
        if n > limit:
            raise ValueError(f"a string of {n} bytes at byte {self.offset} (at most {limit} here)")
        return self.take(n).decode("utf-8", "replace")

    def skip(self, n: int) -> None:
        self.need(n)
        self.offset += n

    def skip_value(self, kind: int) -> None:
        if kind in FIXED:
            self.skip(FIXED[kind])
        elif kind == STRING:
            self.skip(self.unpack("<Q"))
        elif kind == ARRAY:
            inner, count = self.unpack("<IQ")
            if inner in FIXED:
                self.skip(FIXED[inner] * count)
            elif inner == STRING:
                if count * 8 > len(self.buffer) - self.offset:
                    raise ValueError(f"an array of {count} strings is longer than the file")
                unpack, buffer, offset = struct.unpack_from, self.buffer, self.offset
                end = len(buffer)
                for _ in range(count):  # (the hot loop: 100,000 strings for a small model's tokenizer)
                    if offset + 8 > end:
                        raise ValueError("a string array runs past the file's end")
                    offset += 8 + unpack("<Q", buffer, offset)[0]
                if offset > end:
                    raise ValueError("a string array runs past the file's end")
                self.offset = offset
            elif inner == ARRAY:
                if count > len(self.buffer) - self.offset:
                    raise ValueError(f"an array of {count} arrays is longer than the file")
                for _ in range(count):
                    self.skip_value(ARRAY)
            else:
                raise ValueError(f"unknown metadata array type {inner}")
        else:
            raise ValueError(f"unknown metadata value type {kind}")
