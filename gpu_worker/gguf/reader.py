"""A GGUF file's header, parsed without reading tensor data, and its tensors' raw blocks.

``gguf.GGUFReader`` builds a numpy view per metadata element: five seconds for the
default model's 49k-token vocabulary and 49k merges, at every start of every process.
This parser walks the header with ``struct`` instead (string arrays are skipped unless
asked for: a tokenizer's tokens and merges are read once, when the file is prepared)
and maps the file once; a tensor's blocks are a slice of that map. The format's
constants (magic, value types, block sizes) are gguf's own.

Every problem is a ``GGUFError`` with one line naming the file and what is wrong:
a bad magic, an unknown version, value type or ggml type, a header or tensor that runs
past the end of the file, a row that is not a whole number of blocks.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType

VERSIONS = (2, 3)
# GGUFValueType -> struct format of one scalar
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}
_STRING, _ARRAY = 8, 9
# numeric array element types as numpy dtypes (little-endian)
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}


class GGUFError(ValueError):
    """A file Candor cannot read as GGUF; the message is one line."""


@dataclass(frozen=True)
class SkippedStrings:
    """A string array the parse walked past (``count`` strings)."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the table. ``shape`` is HF's order (ggml lists the fastest-moving
    dimension first): a weight is [out_features, in_features]; ``start`` is its first
    byte in the file."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    start: int
    n_bytes: int

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return self.shape[-1] // block * size

    @property
    def rows(self) -> int:
        return prod(self.shape[:-1])


class _Cursor:
    """Reads little-endian values from the mapped header, refusing to run past the end."""

    def __init__(self, data: np.ndarray, path: Path) -> None:
        self.data, self.path, self.pos = data, path, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise GGUFError(f"{self.path}: truncated: the header ends before byte {self.pos + size} "
                            f"(the file has {len(self.data)} bytes)")
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.take("<Q")
        end = self.pos + length
        if end > len(self.data):
            raise GGUFError(f"{self.path}: truncated: a header string ends at byte {end} "
                            f"(the file has {len(self.data)} bytes)")
        raw = bytes(self.data[self.pos:end])
        self.pos = end
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: a header string at byte {end - length} is not UTF-8") from None

    def value(self, kind: int, key: str, keep_strings: bool) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GGUFError(f"{self.path}: metadata {key!r} has unknown value type {kind}")
        element, count = self.take("<IQ")
        if element in _NUMPY:
            dtype = np.dtype(_NUMPY[element])
            end = self.pos + count * dtype.itemsize
            if end > len(self.data):
                raise GGUFError(f"{self.path}: truncated: metadata {key!r} ends at byte {end} "
                                f"(the file has {len(self.data)} bytes)")
            values = np.frombuffer(self.data, dtype, count, self.pos).tolist()
            self.pos = end
            return values
        if element == _STRING:
            if keep_strings:
                return [self.string() for _ in range(count)]
            for _ in range(count):
                length = self.take("<Q")  # (read before adding: take moves pos)
                self.pos += length
            if self.pos > len(self.data):
                raise GGUFError(f"{self.path}: truncated: metadata {key!r} runs past the end of the file")
            return SkippedStrings(count)
        if element == _ARRAY:
            return [self.value(_ARRAY, key, keep_strings) for _ in range(count)]
        raise GGUFError(f"{self.path}: metadata {key!r} is an array of unknown value type {element}")


class GGUFFile:
    """The header of ``path`` and a read-only map of the whole file.

    ``metadata``: every key, values decoded (numeric arrays as lists; string arrays as
    ``SkippedStrings`` unless named in ``string_arrays``); ``tensors``: the tensor table
    by GGUF name, in file order."""

    def __init__(self, path: str | Path, string_arrays: tuple[str, ...] = ()) -> None:
        self.path = Path(path)
        try:
            self.size = self.path.stat().st_size
            self.data = np.memmap(self.path, dtype=np.uint8, mode="r") if self.size else np.zeros(0, np.uint8)
        except OSError as err:
            raise GGUFError(f"{self.path}: cannot be read: {err.strerror or err}") from None
        cur = _Cursor(self.data, self.path)
        if self.size < 4 or cur.take("<I") != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (it does not start with the magic 'GGUF')")
        self.version = cur.take("<I")
        if self.version not in VERSIONS:
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported "
                            f"(supported: {', '.join(map(str, VERSIONS))})")
        n_tensors, n_kv = cur.take("<QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.take("<I"), key, key in string_arrays)
        table = [self._entry(cur) for _ in range(n_tensors)]
        alignment = int(self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        self.data_start = (cur.pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, ggml_type, shape, offset in table:
            info = TensorInfo(name, ggml_type, shape, self.data_start + offset,
                              prod(shape) // GGML_QUANT_SIZES[ggml_type][0] * GGML_QUANT_SIZES[ggml_type][1])
            if info.start + info.n_bytes > self.size:
                raise GGUFError(f"{self.path}: truncated: tensor {name} needs bytes up to "
                                f"{info.start + info.n_bytes}, the file has {self.size}")
            if name in self.tensors:
                raise GGUFError(f"{self.path}: tensor {name} appears twice")
            self.tensors[name] = info

    def _entry(self, cur: _Cursor) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
        name = cur.string()
        n_dims = cur.take("<I")
        if not 1 <= n_dims <= 4:
            raise GGUFError(f"{self.path}: tensor {name} has {n_dims} dimensions")
        dims = [cur.take("<Q") for _ in range(n_dims)]
        type_id, offset = cur.take("<IQ")
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFError(f"{self.path}: tensor {name} has unknown ggml type id {type_id}") from None
        if ggml_type not in GGML_QUANT_SIZES:
            raise GGUFError(f"{self.path}: tensor {name} has ggml type {ggml_type.name}, whose block size "
                            "gguf does not know")
        block = GGML_QUANT_SIZES[ggml_type][0]
        if dims[0] % block:
            raise GGUFError(f"{self.path}: tensor {name}: rows of {dims[0]} elements are not whole "
                            f"{ggml_type.name} blocks of {block}")
        return name, ggml_type, tuple(reversed(dims)), offset

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as stored: a read-only uint8 view [rows, row_bytes]."""
        return self.data[info.start:info.start + info.n_bytes].reshape(info.rows, info.row_bytes)
