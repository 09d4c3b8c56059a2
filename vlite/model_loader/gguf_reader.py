"""A lean reader of GGUF headers: metadata and tensor records, tensor data as views of one memory map.

`gguf.GGUFReader` builds a numpy view for every part of every metadata value; a Llama 3 file's 128k
tokens and 280k merges make that seconds of work at every start, most of it for strings nobody reads.
Here a value is decoded only when asked for (`GGUFField.contents`), string arrays are walked once for
their offsets, and the tensors are the same numpy views of the file's map that gguf's reader gives
(quantized types as uint8 rows of their blocks, dims fastest-first in `shape`), so everything below
reads either reader.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf import quant_shape_to_byte_shape

# scalar value types -> struct format (little-endian)
_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {t: np.dtype(f) for t, f in _SCALAR.items()}
# tensor types gguf's reader hands out typed (everything else: uint8 bytes of its blocks)
_TYPED = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}


@dataclass
class GGUFField:
    """One metadata key: its type(s), and where its value lies in the file (decoded on demand)."""

    name: str
    types: list[GGUFValueType]
    _buf: memoryview = field(repr=False)
    _offset: int = 0  # of the value (after the type tag)
    _count: int = 0  # array length
    _string_offsets: Union[np.ndarray, None] = field(default=None, repr=False)  # string arrays: each length's offset

    def contents(self) -> Any:
        """The value as Python data: str, int, float, bool, or a list of them (gguf's `contents()`)."""
        main = self.types[0]
        if main == GGUFValueType.STRING:
            return _read_str(self._buf, self._offset)[0]
        if main != GGUFValueType.ARRAY:
            return struct.unpack_from(_SCALAR[main], self._buf, self._offset)[0]
        sub = self.types[-1]
        if sub == GGUFValueType.STRING:
            return [s.decode("utf-8") for s in self.string_bytes()]
        if len(self.types) > 2:  # arrays of arrays: rare; walk them
            return _read_value(self._buf, self._offset, GGUFValueType.ARRAY)[0]
        return np.frombuffer(self._buf, _NUMPY[sub], self._count, self._offset + 12).tolist()

    def string_bytes(self) -> list[bytes]:
        """A string array's items as raw bytes (no utf-8 decoding)."""
        assert self._string_offsets is not None, f"{self.name} is not an array of strings"
        buf = self._buf
        return [bytes(buf[o + 8:o + 8 + struct.unpack_from("<Q", buf, o)[0]]) for o in self._string_offsets.tolist()]

    def __len__(self) -> int:
        return self._count


@dataclass
class GGUFTensor:
    """One tensor record, as gguf's ReaderTensor: `shape` fastest-first, `data` a view of the map."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


def _read_str(buf: memoryview, off: int) -> tuple[str, int]:
    n = struct.unpack_from("<Q", buf, off)[0]
    end = off + 8 + n
    if end > len(buf):
        raise ValueError(f"string at byte {off} runs past the end of the file")
    return str(buf[off + 8:end], "utf-8"), end


def _read_value(buf: memoryview, off: int, vtype: GGUFValueType) -> tuple[Any, int]:
    """A value at `off` (eagerly; used for nested arrays) and the offset after it."""
    if vtype == GGUFValueType.STRING:
        return _read_str(buf, off)
    if vtype != GGUFValueType.ARRAY:
        fmt = _SCALAR[vtype]
        return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)
    sub, count = struct.unpack_from("<IQ", buf, off)
    off += 12
    items = []
    for _ in range(count):
        item, off = _read_value(buf, off, GGUFValueType(sub))
        items.append(item)
    return items, off


def _skip_array(buf: memoryview, off: int, name: str) -> tuple[GGUFField, int]:
    sub, count = struct.unpack_from("<IQ", buf, off)
    sub = GGUFValueType(sub)
    types = [GGUFValueType.ARRAY, sub]
    string_offsets = None
    if sub == GGUFValueType.STRING:  # walk the lengths: the only per-item work of a header
        offsets = np.empty(count, np.int64)
        pos = off + 12
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            offsets[i] = pos
            pos += 8 + unpack(buf, pos)[0]
        end, string_offsets = pos, offsets
    elif sub == GGUFValueType.ARRAY:
        end = _read_value(buf, off, GGUFValueType.ARRAY)[1]
        inner = off + 12
        while count and sub == GGUFValueType.ARRAY:  # the first item's types, as gguf's reader lists them
            sub, count = struct.unpack_from("<IQ", buf, inner)
            sub = GGUFValueType(sub)
            types.append(sub)
            inner += 12
    else:
        end = off + 12 + count * _NUMPY[sub].itemsize
    if end > len(buf):
        raise ValueError(f"metadata {name!r} runs past the end of the file")
    return GGUFField(name, types, buf, off, count, string_offsets), end


class GGUFReader:
    """The header of a GGUF file (version 2 or 3) over a read-only memory map of the whole file.

    `fields` (key -> GGUFField), `tensors` (in file order), `data` (the map, uint8), `alignment`."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.data = np.memmap(path, mode="r")
        buf = memoryview(self.data)
        magic, version = struct.unpack_from("<II", buf, 0)
        if magic != GGUF_MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        off = 24
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_kv):
            name, off = _read_str(buf, off)
            vtype = GGUFValueType(struct.unpack_from("<I", buf, off)[0])
            off += 4
            if vtype == GGUFValueType.ARRAY:
                fld, off = _skip_array(buf, off, name)
            else:
                fld = GGUFField(name, [vtype], buf, off)
                off = _read_value(buf, off, vtype)[1]
            self.fields[name] = fld
        records = []
        for _ in range(n_tensors):
            name, off = _read_str(buf, off)
            n_dims = struct.unpack_from("<I", buf, off)[0]
            dims = np.frombuffer(buf, np.uint64, n_dims, off + 4).copy()
            off += 4 + 8 * n_dims
            ttype, data_off = struct.unpack_from("<IQ", buf, off)
            off += 12
            records.append((name, dims, GGMLQuantizationType(ttype), data_off))
        align_field = self.fields.get("general.alignment")
        self.alignment = int(align_field.contents()) if align_field is not None else GGUF_DEFAULT_ALIGNMENT
        start = off + (-off % self.alignment)
        self.tensors = [self._tensor(start, *record) for record in records]

    def _tensor(self, start: int, name: str, dims: np.ndarray, ttype: GGMLQuantizationType,
                data_off: int) -> GGUFTensor:
        block, type_size = GGML_QUANT_SIZES[ttype]
        n_elements = int(np.prod(dims, dtype=np.int64))
        n_bytes = n_elements * type_size // block
        begin = start + data_off
        if begin + n_bytes > len(self.data):
            raise ValueError(f"tensor {name!r} ({n_bytes} bytes at {begin}) runs past the end of the file "
                             f"({len(self.data)} bytes)")
        np_dims = tuple(int(d) for d in reversed(dims.tolist()))
        item = _TYPED.get(ttype)
        if item is None:
            view = self.data[begin:begin + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, ttype))
        else:
            view = self.data[begin:begin + n_bytes].view(item).reshape(np_dims)
        return GGUFTensor(name, ttype, dims, n_elements, n_bytes, begin, view)


def transformers_metadata(fields: dict[str, GGUFField], string_arrays: Any = ()) -> dict[str, Any]:
    """The header's values as transformers' own GGUF reader gives them (`read_gguf_metadata`): scalars and
    numeric arrays as Python values, string arrays as their length unless named in `string_arrays`."""
    out: dict[str, Any] = {}
    for name, f in fields.items():
        if f.types[0] == GGUFValueType.ARRAY and f.types[-1] == GGUFValueType.STRING and name not in string_arrays:
            out[name] = len(f)
        else:
            out[name] = f.contents()
    return out
