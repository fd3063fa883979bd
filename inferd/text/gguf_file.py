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
"""

from __future__ import annotations

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

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
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
            return [self.value(elem_type) for _ in range(count)]
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
        if n_tensors > 1 << 24 or n_kv > 1 << 24:
            raise ModelLoadError(f"{self.path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")

        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack(_U32))

        index: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack(_U32)
            if n_dims > 8:
                raise ModelLoadError(f"{self.path}: corrupt tensor info for {name!r} ({n_dims} dims)")
            dims = tuple(cur.unpack(_U64) for _ in range(n_dims))
            index.append((name, dims, cur.unpack(_U32), cur.unpack(_U64)))

        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, type_id, offset in index:
            try:
                ggml_type = GGMLQuantizationType(type_id)
            except ValueError:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has unknown GGML type {type_id}") from None
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            n_elements = int(np.prod(dims)) if dims else 1
            if dims and dims[0] % block:
                raise ModelLoadError(f"{self.path}: tensor {name!r} row length {dims[0]} is not a multiple of {block}")
            n_bytes = n_elements // block * type_size
            start = data_start + offset
            if start + n_bytes > len(self._map):
                raise ModelLoadError(
                    f"{self.path}: truncated file: tensor {name!r} ends at byte {start + n_bytes}, "
                    f"file has {len(self._map)}"
                )
            self.tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, start, n_bytes)

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
