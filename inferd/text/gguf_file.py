"""A fast reader for GGUF headers: metadata and the tensor index.

NOTE: `gguf.GGUFReader` builds a numpy view for every metadata string (~98k for a 49k-token
vocabulary), which costs 2.5-3.5 s at every start. This reader walks the same header with
`struct` in ~0.1 s and maps tensor data lazily with numpy; it still uses the `gguf` package
for the format's constants and for dequantization.

File layout (all little-endian):

    "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: str, value_type u32, value)        str = len u64 + utf-8 bytes
    n_tensors x (name: str, n_dims u32, dims u64[n_dims], ggml_type u32, offset u64)
    padding to `general.alignment` (default 32)
    tensor data; each tensor at data_start + offset; dims[0] is the innermost (row) length

Every count, length and offset is checked against the file before it is used (a file is
untrusted input: Ollama's CVE-2026-7482 was a tensor whose offset pointed past the end), so a
corrupt or hostile header is a ModelLoadError naming the file, never a giant allocation, a loop
over a count the file cannot hold, or a read past the end. As llama.cpp's reader: at most 4 dims
(GGML_MAX_DIMS), no array of arrays, no key or tensor name twice, an alignment that is a power of
two, no empty tensor, each tensor's data aligned and apart from every other's.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from inferd.text.errors import ModelLoadError

_SCALARS: dict[int, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_NUMPY_OF: dict[int, str] = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# the fewest bytes a key takes (its name's length 8, an empty name, its type 4, a u8 value 1) and a
# tensor's info (name length 8, n_dims 4, one dim 8, type 4, offset 8): the counts are checked so
_MIN_KEY_BYTES, _MIN_TENSOR_BYTES = 13, 32


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy / torch order: outermost first (the reverse of GGUF dims)
    ggml_type: GGMLQuantizationType
    data_offset: int  # absolute byte offset in the file
    n_bytes: int


class _Cursor:
    """Bounds-checked reads over the mapped file; running off the end means a truncated file."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelLoadError(
                f"{self.path}: truncated or corrupt GGUF header "
                f"(needs {n} bytes at offset {self.pos}, file has {len(self.buf)})"
            )

    def unpack(self, fmt: struct.Struct) -> Any:
        self.need(fmt.size)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def string(self) -> str:
        n = self.unpack(_U64)
        self.need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, in_array: bool = False) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            if in_array:  # (as llama.cpp: an array of arrays is refused, so nesting never runs deep)
                raise ModelLoadError(f"{self.path}: corrupt GGUF metadata (an array of arrays at offset {self.pos})")
            elem_type = self.unpack(_U32)
            count = self.unpack(_U64)
            if elem_type in _NUMPY_OF:
                dtype = np.dtype(_NUMPY_OF[elem_type])
                self.need(count * dtype.itemsize)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return arr.tolist()
            # every element takes at least 8 bytes (a string's length), so this catches a cut
            self.need(count * (8 if elem_type == GGUFValueType.STRING else 1))
            return [self.value(elem_type, in_array=True) for _ in range(count)]
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise ModelLoadError(f"{self.path}: corrupt GGUF metadata value type {vtype}")
        return self.unpack(fmt)


class GGUFFile:
    """An open GGUF file: `metadata` (plain Python values) and `tensors` (name -> info).

    Tensor bytes are read on demand with `raw(name)` from a read-only memory map.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such file")
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file cannot be mapped
                raise ModelLoadError(f"{self.path}: not a GGUF file ({e})") from None
        cur = _Cursor(memoryview(self._map), self.path)
        cur.need(4)
        if bytes(cur.buf[:4]) != b"GGUF":
            raise ModelLoadError(f"{self.path}: not a GGUF file (bad magic {bytes(cur.buf[:4])!r})")
        cur.pos = 4
        self.version = cur.unpack(_U32)
        if self.version not in (2, 3):
            raise ModelLoadError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors = cur.unpack(_U64)
        n_kv = cur.unpack(_U64)
        if n_kv * _MIN_KEY_BYTES + n_tensors * _MIN_TENSOR_BYTES > len(cur.buf) - cur.pos:
            raise ModelLoadError(f"{self.path}: corrupt GGUF header ({n_tensors} tensors and {n_kv} keys "
                                 f"cannot fit in a file of {len(cur.buf)} bytes)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            if key in self.metadata:
                raise ModelLoadError(f"{self.path}: corrupt GGUF metadata (key {key!r} twice)")
            self.metadata[key] = cur.value(cur.unpack(_U32))
        index = [self._tensor_info(cur) for _ in range(n_tensors)]
        self.tensors: dict[str, GGUFTensorInfo] = {}
        self._place(index, cur.pos)

    def _tensor_info(self, cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        """One tensor's (name, dims, GGML type id, offset) from the index."""
        name = cur.string()
        n_dims = cur.unpack(_U32)
        if not 1 <= n_dims <= MAX_DIMS:
            raise ModelLoadError(f"{self.path}: corrupt tensor info for {name!r} ({n_dims} dims)")
        dims = tuple(cur.unpack(_U64) for _ in range(n_dims))
        if 0 in dims:  # (no weight is empty; every reader of one would divide by its rows)
            raise ModelLoadError(f"{self.path}: corrupt tensor info for {name!r} (dims {list(dims)})")
        return name, dims, cur.unpack(_U32), cur.unpack(_U64)

    def _alignment(self) -> int:
        alignment = self.metadata.get("general.alignment", 32)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise ModelLoadError(f"{self.path}: corrupt GGUF metadata (general.alignment {alignment!r} is not a "
                                 "power of two)")
        return alignment

    def _place(self, index: list[tuple[str, tuple[int, ...], int, int]], header_end: int) -> None:
        """Each tensor's type, size and place in the file, checked: a known type, whole blocks,
        aligned, inside the file, apart from the others."""
        alignment = self._alignment()
        data_start = (header_end + alignment - 1) // alignment * alignment
        size = len(self._map)
        for name, dims, type_id, offset in index:
            if name in self.tensors:
                raise ModelLoadError(f"{self.path}: corrupt GGUF tensor index (tensor {name!r} twice)")
            try:
                ggml_type = GGMLQuantizationType(type_id)
            except ValueError:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has unknown GGML type {type_id}") from None
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            if dims[0] % block:
                raise ModelLoadError(f"{self.path}: tensor {name!r} row length {dims[0]} is not a multiple of {block}")
            n_bytes = math.prod(dims) // block * type_size  # (exact: Python ints, no overflow)
            start = data_start + offset
            if start + n_bytes > size:
                raise ModelLoadError(f"{self.path}: tensor {name!r} ends at byte {start + n_bytes}, past the end "
                                     f"of the file ({size} bytes): a truncated or corrupt file")
            if offset % alignment:
                raise ModelLoadError(f"{self.path}: corrupt GGUF tensor index (tensor {name!r} at offset {offset}, "
                                     f"not a multiple of the alignment {alignment})")
            self.tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, start, n_bytes)
        placed = sorted(self.tensors.values(), key=lambda t: (t.data_offset, t.n_bytes))
        for before, after in zip(placed, placed[1:]):
            if before.data_offset + before.n_bytes > after.data_offset:
                raise ModelLoadError(f"{self.path}: corrupt GGUF tensor index (tensors {before.name!r} and "
                                     f"{after.name!r} overlap)")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored: uint8 `[rows..., row_bytes]` for quantized types,
        the element dtype otherwise (a zero-copy view of the mapped file)."""
        info = self.tensors[name]
        flat = np.frombuffer(self._map, dtype=np.uint8, count=info.n_bytes, offset=info.data_offset)
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]
        if block == 1 and info.ggml_type in _PLAIN_DTYPES:
            return flat.view(_PLAIN_DTYPES[info.ggml_type]).reshape(info.shape)
        row_bytes = info.shape[-1] // block * type_size
        return flat.reshape(*info.shape[:-1], row_bytes)

    def close(self) -> None:
        self._map.close()


_PLAIN_DTYPES: dict[GGMLQuantizationType, np.dtype] = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}
