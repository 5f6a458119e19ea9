"""Reads an untrusted safetensors file without trusting it: header first, bounded, then the data in chunks.

A safetensors file is `u64 little-endian header length | JSON header | raw tensor bytes`. The format
cannot run code, but a hostile header can still hurt a parser that believes it: a length of 2**63,
millions of entries, offsets that overlap or point past the end, shapes whose product wraps around in
64 bits, or zero-size tensors. Every one of those is refused here *before* a byte of tensor data is
read, and the data is then scanned for NaN/Inf in fixed-size chunks, so memory stays bounded no matter
how large the file is. Nothing here imports Django or torch: the web process and the tests use it as is.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO, Protocol

import numpy as np

# An adapter for a 126-layer base with all seven projections has 1,764 tensors and a header of
# roughly 300 KB; these limits leave room for that and nothing near what an attack needs.
MAX_HEADER_BYTES = 4 * 1024 * 1024
MAX_ENTRIES = 20_000
MAX_DIMS = 8
MAX_METADATA_BYTES = 64 * 1024
SCAN_CHUNK_BYTES = 4 * 1024 * 1024

# Floating-point dtypes a LoRA adapter is stored in, with the element size and the bit mask of the
# exponent field: an element whose exponent bits are all ones is NaN or ±Inf, in every IEEE format.
DTYPES: dict[str, tuple[int, str, int]] = {
    "F32": (4, "<u4", 0x7F80_0000),
    "F16": (2, "<u2", 0x7C00),
    "BF16": (2, "<u2", 0x7F80),
}
DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class SafetensorsError(ValueError):
    """The file is not a safetensors file we accept; `field` names the tensor (or "header")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str                   # safetensors spelling: "F32", "F16", "BF16"
    shape: tuple[int, ...]
    begin: int                   # byte offsets relative to the start of the data section
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class SafetensorsLayout:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int              # absolute file offset of the data section
    data_size: int


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict:
    # Two entries with one name would let two readers see two different tensors.
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise SafetensorsError("header", f"the safetensors header names {key!r} twice.")
        seen[key] = value
    return seen


def _reject_constant(token: str):
    raise SafetensorsError("header", f"the safetensors header contains {token}, which is not JSON.")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class HeaderSource(Protocol):
    """What read_layout needs of a file: an open binary file, or a buffer that can seek and read."""

    def seek(self, offset: int, whence: int = 0, /) -> object: ...

    def read(self, size: int, /) -> bytes: ...


def read_layout(fh: HeaderSource, file_size: int, *, max_header_bytes: int = MAX_HEADER_BYTES,
                max_entries: int = MAX_ENTRIES) -> SafetensorsLayout:
    """Parse and check the header of the safetensors file open in `fh` (positioned anywhere).

    Checks: length prefix within the file and the limit; UTF-8 JSON object; no duplicate names; at
    most `max_entries` tensors; whitelisted dtype; shape of non-negative ints whose product (computed
    exactly, so it cannot wrap) matches the byte range; no zero-size tensor; byte ranges that tile the
    data section exactly — in order, no gap, no overlap, nothing left over.
    """
    if file_size < 8:
        raise SafetensorsError("header", f"the file is {file_size} bytes, too short to be safetensors.")
    fh.seek(0)
    (header_len,) = struct.unpack("<Q", fh.read(8))
    if header_len > max_header_bytes:
        raise SafetensorsError(
            "header", f"the safetensors header declares {header_len} bytes; the limit is {max_header_bytes}."
        )
    if 8 + header_len > file_size:
        raise SafetensorsError(
            "header", f"the safetensors header declares {header_len} bytes but the file has only "
                      f"{file_size - 8} after the length prefix (truncated file?)."
        )
    raw = fh.read(header_len)
    if len(raw) != header_len:
        raise SafetensorsError("header", "the file ended inside the safetensors header (truncated file?).")
    if not raw.startswith(b"{"):
        raise SafetensorsError("header", "the safetensors header is not a JSON object.")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates,
                            parse_constant=_reject_constant)
    except SafetensorsError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise SafetensorsError("header", "the safetensors header is not valid UTF-8 JSON.") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header", "the safetensors header is not a JSON object.")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SafetensorsError("__metadata__", "the safetensors __metadata__ must map strings to strings.")
    if len(json.dumps(metadata)) > MAX_METADATA_BYTES:
        raise SafetensorsError("__metadata__", f"the safetensors __metadata__ is over {MAX_METADATA_BYTES} bytes.")
    if len(header) > max_entries:
        raise SafetensorsError(
            "header", f"the safetensors header lists {len(header)} tensors; the limit is {max_entries}."
        )

    data_start = 8 + header_len
    data_size = file_size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        tensors[name] = _tensor_info(name, entry, data_size)

    # The byte ranges must tile [0, data_size) exactly: sorted by start, each begins where the
    # previous ended. Overlap would let two tensors alias; a gap or a tail would hide bytes.
    position = 0
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin < position:
            raise SafetensorsError(info.name, f"tensor {info.name} overlaps the previous tensor "
                                              f"(starts at byte {info.begin}, before {position}).")
        if info.begin > position:
            raise SafetensorsError(info.name, f"tensor {info.name} starts at byte {info.begin}, leaving "
                                              f"unaccounted bytes {position}–{info.begin}.")
        position = info.end
    if position != data_size:  # only ever short: _tensor_info refused any end past data_size
        raise SafetensorsError(
            "header", f"the tensors cover {position} bytes but the data section has {data_size} "
                      f"(extra bytes after the last tensor)."
        )
    return SafetensorsLayout(tensors=tensors, metadata=dict(metadata), data_start=data_start,
                             data_size=data_size)


def _tensor_info(name: str, entry: object, data_size: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise SafetensorsError(name, f"tensor {name}: header entry is not an object.")
    extra = set(entry) - {"dtype", "shape", "data_offsets"}
    if extra:
        raise SafetensorsError(name, f"tensor {name}: unexpected header fields {sorted(extra)}.")
    dtype = entry.get("dtype")
    if dtype not in DTYPES:
        raise SafetensorsError(
            name, f"tensor {name} has dtype {dtype!r}; adapters must be {', '.join(DTYPES)}."
        )
    shape = entry.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        raise SafetensorsError(name, f"tensor {name} has an invalid shape {shape!r}.")
    offsets = entry.get("data_offsets")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise SafetensorsError(name, f"tensor {name} has invalid data_offsets {offsets!r}.")
    begin, end = offsets
    if end > data_size:
        raise SafetensorsError(
            name, f"tensor {name} ends at byte {end} but the data section has only {data_size} "
                  f"(truncated file?)."
        )
    itemsize = DTYPES[dtype][0]
    # Exact integer arithmetic, compared with what the file can hold: a product that would wrap in
    # 64 bits (e.g. [2**32, 2**32]) is simply far larger than the byte range and is refused.
    numel = 1
    for d in shape:
        numel *= d
        if numel * itemsize > data_size:
            raise SafetensorsError(
                name, f"tensor {name} has shape {shape}, more elements than the file can hold."
            )
    if numel == 0:
        raise SafetensorsError(name, f"tensor {name} has shape {shape} with no elements.")
    if numel * itemsize != end - begin:
        raise SafetensorsError(
            name, f"tensor {name} has shape {shape} ({numel * itemsize} bytes of {dtype}) but its "
                  f"data_offsets span {end - begin} bytes."
        )
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def iter_tensor_chunks(fh: BinaryIO, layout: SafetensorsLayout, info: TensorInfo,
                       chunk_bytes: int = SCAN_CHUNK_BYTES) -> Iterator[bytes]:
    """The raw bytes of one tensor, in chunks that are whole elements (never the whole tensor at once)."""
    itemsize = DTYPES[info.dtype][0]
    step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    fh.seek(layout.data_start + info.begin)
    remaining = info.end - info.begin
    while remaining:
        chunk = fh.read(min(step, remaining))
        if not chunk:
            raise SafetensorsError(info.name, f"the file ended inside tensor {info.name} (truncated file?).")
        remaining -= len(chunk)
        yield chunk


def check_finite(fh: BinaryIO, layout: SafetensorsLayout, chunk_bytes: int = SCAN_CHUNK_BYTES) -> None:
    """Refuse any tensor holding NaN or ±Inf, scanning bit patterns chunk by chunk.

    Working on the exponent bits (not on floats) covers bfloat16, which numpy cannot represent, and
    never materialises more than one chunk.
    """
    for info in sorted(layout.tensors.values(), key=lambda t: t.begin):
        _, word, exponent_mask = DTYPES[info.dtype]
        seen = 0
        for chunk in iter_tensor_chunks(fh, layout, info, chunk_bytes):
            bits = np.frombuffer(chunk, dtype=word)
            bad = np.flatnonzero((bits & exponent_mask) == exponent_mask)
            if bad.size:
                raise SafetensorsError(
                    info.name, f"tensor {info.name} contains NaN or Inf (element {seen + int(bad[0])})."
                )
            seen += bits.size
