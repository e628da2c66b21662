"""Lazy reading and writing of the safetensors format (8-byte header length, JSON header, raw data).

Our own reader memory-maps each file and converts one tensor at a time, so peak host memory is one
tensor (plus what the caller stacks), never the file set. It knows the dtypes of M3 checkpoints,
including BF16 and F8_E4M3 (through ml_dtypes), and reports truncated or malformed files by name.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from m3jax.atomic import NotARegularFileError, open_regular

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file or tensor that cannot be loaded; the message names the file and tensor."""


def _is_count(x) -> bool:
    """A non-negative JSON integer (JSON true/false parse as bool, a subclass of int)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class SafetensorsFile:
    """One ``.safetensors`` file: header parsed eagerly, tensors read lazily through a memmap."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        # One descriptor for the header and every tensor: a save that replaces the file meanwhile
        # cannot hand this reader tensors of another file than the header it checked.
        try:
            self._file = open_regular(self.path, "a safetensors file")
        except NotARegularFileError as e:
            raise CheckpointError(str(e)) from None
        f = self._file
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{self.path}: file is truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise CheckpointError(f"{self.path}: file is truncated (header of {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (__metadata__ is not an object)")
        self.data_start = 8 + n
        self.entries: dict[str, dict] = header
        spans = []
        for name, e in header.items():
            try:
                dtype, shape, (begin, end) = e["dtype"], e["shape"], e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(
                    f"{self.path}: corrupt header entry for tensor {name!r} (needs dtype, shape, data_offsets)"
                ) from None
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype!r}")
            if not isinstance(shape, list) or not all(map(_is_count, shape)):
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} has shape {shape!r}; dims must be non-negative integers")
            # Offsets are relative to the data section: a negative one would read header bytes as weights.
            if not (_is_count(begin) and _is_count(end) and begin <= end):
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} has data_offsets {[begin, end]!r}; need integers 0 <= begin <= end")
            want = math.prod(shape) * DTYPES[dtype].itemsize
            if end - begin != want:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} spans {end - begin} bytes but shape {shape} {dtype} needs {want}"
                )
            if self.data_start + end > size:
                raise CheckpointError(
                    f"{self.path}: file is truncated: tensor {name!r} ends at byte {self.data_start + end} "
                    f"but the file has {size} bytes"
                )
            if end > begin:
                spans.append((begin, end, name))
        # Sorted by start, two non-empty byte ranges overlap only if some neighbouring pair does.
        spans.sort()
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            if begin < end:
                raise CheckpointError(
                    f"{self.path}: tensors {a!r} and {b!r} overlap (bytes {begin} to {end} of the data); "
                    "corrupt safetensors header"
                )

    def close(self) -> None:
        self._file.close()

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return DTYPES[self.entries[name]["dtype"]]

    def get(self, name: str) -> np.ndarray:
        """Read-only view of the tensor (pages are read on access).

        Each call maps only this tensor's bytes (of the descriptor opened with the header, never the
        path again), and the mapping is released with the returned view, so a long load never keeps
        the whole file set resident.
        """
        e = self.entries[name]
        begin, end = e["data_offsets"]
        if end == begin:
            return np.empty(e["shape"], DTYPES[e["dtype"]])
        buf = np.memmap(self._file, dtype=np.uint8, mode="r", offset=self.data_start + begin, shape=(end - begin,))
        return buf.view(DTYPES[e["dtype"]]).reshape(e["shape"])


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write tensors (numpy, any dtype in :data:`DTYPES`) to one safetensors file."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"cannot write tensor {name!r} of dtype {a.dtype}")
        header[name] = {"dtype": DTYPE_NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
