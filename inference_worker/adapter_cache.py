"""Adapters on their way from storage to the device pool: verify, parse, keep hot, pin while in use.

    loader(storage_key) -> a buffer   (injected: bytes from any storage, or `map_file` for a local file)
      -> sha256 == job's AdapterRef.sha256, else `adapter_integrity_error` (never served)
      -> safetensors header checked (protocol.safetensors_check), tensors viewed in place (never pickle)
      -> names and shapes checked against the base model's projections
      -> host LRU, bounded in bytes
      -> pages of the device memory pool, as many as its real rank and targets need (runner.load_adapter)

Everything is keyed by the adapter's *identity* (AdapterRef.identity: the weights' sha256 and the config
that scales and places them), never by the weights' hash alone: two versions with the same bytes and
another lora_alpha are two entries, so one tenant's config can never change another's answers.

Residency (S-LoRA's unified pool): an adapter used by an in-flight sequence is pinned and never evicted.
Idle adapters stay resident while pages are free and are evicted, least recently used first, when a cold
adapter needs room (`acquire`) or the KV cache needs pages to admit a request (`reclaim`). When pinned
adapters and KV blocks leave no room, `acquire` answers NO_ROOM and the engine keeps the request waiting.

Threading: cold loads (read, hash, parse, check) run on a small loader pool so a slow storage read never
stalls the engine's step loop. Everything that touches the runner (placing an adapter into pages) runs on
the thread that calls `acquire`, i.e. the engine thread, between forward passes. Concurrent requests for
one cold adapter share one load.
"""
from __future__ import annotations

import functools
import hashlib
import mmap
import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NoReturn

import torch

from protocol.errors import ErrorCode
from protocol.jobs import AdapterRef
from protocol.lora_layout import ModelShape, parse_peft_name
from protocol.safetensors_check import SafetensorsError, read_layout  # Django-free, torch-free

from .lora import NoRoom
from .openmp import release_thread_team

_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def map_file(path: str | os.PathLike) -> mmap.mmap | bytes:
    """A local blob as a private copy-on-write mapping: hashing and parsing it read the page cache in place.

    Measured on an 80 MB adapter here: read() into fresh memory costs ~40 ms (mostly page faults), a
    mapping costs nothing until read, and the sha256 then reads the page cache directly. Blobs are
    content-addressed and never rewritten (adapters.storage), so the bytes the hash verified are the
    bytes the slots receive; a blob deleted later stays readable through the mapping.
    """
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return b""  # mmap refuses empty files; the parse then refuses the blob
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)


class _HeaderReader:
    """The seek/read that read_layout needs, over a buffer, without copying more than the header."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def seek(self, pos: int, whence: int = 0) -> None:
        self.pos = pos

    def read(self, n: int) -> bytes:
        out = bytes(self.view[self.pos:self.pos + n])
        self.pos += len(out)
        return out


def tensors_from_buffer(buf) -> dict[str, torch.Tensor]:
    """Parse untrusted safetensors bytes into tensors that view the buffer (no copy of the data).

    The header goes through the same hardened reader as uploads (bounded, no overlaps, exact sizes, dtype
    whitelist), so every view lies inside the buffer. Raises SafetensorsError."""
    view = memoryview(buf).cast("B")
    layout = read_layout(_HeaderReader(view), len(view))
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():  # bytes are read-only; nothing ever writes to these host tensors
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for name, info in layout.tensors.items():
            dtype = _TORCH_DTYPES[info.dtype]
            start = layout.data_start + info.begin
            if start % dtype.itemsize:  # misaligned (safetensors' own writer aligns): copy this one
                t = torch.frombuffer(bytearray(view[start:layout.data_start + info.end]), dtype=dtype)
            else:
                t = torch.frombuffer(view, dtype=dtype, offset=start, count=info.numel)
            out[name] = t.view(info.shape)
    return out


class AdapterLoadError(Exception):
    """A load that must fail the requests waiting for it, with a code the API reports as is."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class LoraShapes:
    """What a base model accepts: layer count and (in_features, out_features) per target projection."""

    num_layers: int
    modules: dict[str, tuple[int, int]]

    @classmethod
    def from_config(cls, config) -> LoraShapes:
        """From the runner's config or a Hugging Face config dict (protocol.lora_layout's arithmetic)."""
        shape = ModelShape.from_config(config)
        return cls(num_layers=shape.num_layers, modules=shape.peft_modules())  # a fused family's: qkv_proj, ...


@dataclass
class HostAdapter:
    identity: str
    sha256: str
    weights: dict[str, torch.Tensor]  # PEFT names -> lora_A [r, in] / lora_B [out, r]
    nbytes: int
    rank: int
    scale: float
    load_seconds: float = 0.0  # read + verify + parse + check, on the loader thread


def check_adapter_weights(weights: dict[str, torch.Tensor], ref: AdapterRef, shapes: LoraShapes, max_rank: int) -> None:
    """Refuses weights that would not do what the adapter claims (a tensor that lands nowhere would
    otherwise silently serve the base model). Raises AdapterLoadError naming the tensor and the reason."""

    def fail(msg: str) -> NoReturn:
        raise AdapterLoadError(ErrorCode.ADAPTER_LOAD_FAILED, f"adapter {ref.sha256[:12]}: {msg}")

    if ref.rank < 1 or ref.rank > max_rank:
        fail(f"rank {ref.rank} is outside 1..{max_rank}")
    if not weights:
        fail("holds no tensors")
    seen: dict[tuple[int, str], set[str]] = {}
    for name, t in weights.items():
        parsed = parse_peft_name(name)
        if parsed is None or parsed[1] not in shapes.modules:
            fail(f"tensor {name!r} is not a lora_A/lora_B weight of a target projection")
        layer, module, kind = parsed
        if layer >= shapes.num_layers:
            fail(f"tensor {name!r} does not exist in the base model ({shapes.num_layers} layers)")
        if not t.is_floating_point():
            fail(f"tensor {name!r} has dtype {t.dtype}, not floating point")
        d_in, d_out = shapes.modules[module]
        want = (ref.rank, d_in) if kind == "A" else (d_out, ref.rank)
        if tuple(t.shape) != want:
            fail(f"tensor {name!r} has shape {list(t.shape)}, the base model needs {list(want)}")
        seen.setdefault((layer, module), set()).add(kind)
    for (layer, module), kinds in seen.items():
        if kinds != {"A", "B"}:
            fail(f"layer {layer} {module} has lora_{''.join(kinds)} without its pair")


# acquire() answers
READY, LOADING, NO_ROOM, FAILED = "ready", "loading", "no_room", "failed"
NO_SLOT = NO_ROOM  # the name before the unified pool


@dataclass
class Acquired:
    state: str
    slot: int = -1
    error_code: ErrorCode | None = None
    error_message: str | None = None


class AdapterCache:
    def __init__(
        self,
        runner,
        loader: Callable[[str], bytes],
        *,
        host_cache_bytes: int = 2 << 30,
        max_rank: int | None = None,
        shapes: LoraShapes | None = None,
        loader_threads: int = 2,
        on_loaded: Callable[[], None] | None = None,
    ):
        self.runner = runner
        self.loader = loader
        self.host_cache_bytes = int(host_cache_bytes)
        self.max_rank = int(max_rank if max_rank is not None else getattr(runner, "max_lora_rank", 64))
        self.shapes = shapes if shapes is not None else LoraShapes.from_config(runner.config)
        self.on_loaded = on_loaded or (lambda: None)  # wakes the engine when a load ends
        self._pool = ThreadPoolExecutor(max_workers=loader_threads, thread_name_prefix="adapter-load")
        self._hash_pool = ThreadPoolExecutor(max_workers=loader_threads, thread_name_prefix="adapter-hash")
        self._lock = threading.RLock()  # a load may finish (and call back) before add_done_callback returns
        self._host: OrderedDict[str, HostAdapter] = OrderedDict()  # identity -> parsed weights, LRU first
        self._host_bytes = 0
        self._inflight: dict[str, Future] = {}
        self._waiters: dict[str, set[Hashable]] = {}  # identity -> waiters not yet placed
        self._failed: dict[Hashable, AdapterLoadError] = {}  # waiter -> the failure it must report
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # resident identities, least recently used first
        self._pins: dict[str, int] = {}
        self._sha_of: dict[str, str] = {}  # identity -> weights sha256, for worker_status
        self.counters = {
            "hits": 0, "resident_hits": 0, "cold_loads": 0, "load_failures": 0, "host_evictions": 0, "evictions": 0,
            "device_loads": 0, "load_seconds": 0.0, "device_load_seconds": 0.0,
        }

    # ---- engine-thread API -------------------------------------------------------------------

    def pages_for(self, ref: AdapterRef) -> int:
        """Pool pages `ref` will take once resident (known from its config, before it is loaded)."""
        return self.runner.lora.pages_for(ref.rank, ref.target_modules)

    def acquire(self, ref: AdapterRef, waiter: Hashable) -> Acquired:
        """Pins `ref` in the device pool and returns its slot, or says why not yet. Non-blocking; call
        again on a later step while LOADING / NO_ROOM. A FAILED answer is given once per waiter."""
        key = ref.identity
        with self._lock:
            err = self._failed.pop(waiter, None)
            if err is not None:
                return Acquired(FAILED, error_code=err.code, error_message=err.message)
            slot = self._slot_of.get(key)
            if slot is not None:
                self.counters["resident_hits"] += 1
                return self._pin(key, slot, waiter)
            host = self._host.get(key)
            if host is None:
                self._waiters.setdefault(key, set()).add(waiter)
                if key not in self._inflight:
                    self.counters["cold_loads"] += 1
                    fut = self._pool.submit(self._load, ref)
                    self._inflight[key] = fut
                    fut.add_done_callback(functools.partial(self._finish_load, ref))
                return Acquired(LOADING)
            slot = self._place(host)
            if slot is None:
                self._waiters.setdefault(key, set()).add(waiter)  # keeps the host copy from eviction
                return Acquired(NO_ROOM)
            return self._pin(key, slot, waiter)

    def release(self, identity: str) -> None:
        """A sequence using `identity` finished: it may be evicted once no other sequence uses it."""
        with self._lock:
            n = self._pins.get(identity, 0) - 1
            if n <= 0:
                self._pins.pop(identity, None)
            else:
                self._pins[identity] = n

    def reclaim(self, pages: int) -> bool:
        """Evict idle resident adapters (least recently used first) until `pages` pages are free; True when
        they are. Pinned adapters are never evicted."""
        pool = self.runner.pool
        with self._lock:
            for key in list(self._slot_of):
                if pool.num_free >= pages:
                    break
                if self._pins.get(key, 0) == 0:
                    self._evict(key)
            return pool.num_free >= pages

    def forget(self, waiter: Hashable) -> None:
        """A waiting request went away (cancelled): drop what the cache held for it."""
        with self._lock:
            self._failed.pop(waiter, None)
            for key, ws in list(self._waiters.items()):
                ws.discard(waiter)
                if not ws:
                    del self._waiters[key]
            self._evict_host()

    # ---- inspection --------------------------------------------------------------------------

    def resident(self) -> list[str]:
        """Identities of the adapters now in the device pool."""
        with self._lock:
            return list(self._slot_of)

    def resident_sha256(self) -> dict[str, str]:
        """identity -> weights sha256 of the resident adapters."""
        with self._lock:
            return {k: self._sha_of.get(k, "") for k in self._slot_of}

    def host_resident(self) -> list[str]:
        with self._lock:
            return list(self._host)

    def pinned(self) -> dict[str, int]:
        with self._lock:
            return dict(self._pins)

    def stats(self) -> dict:
        with self._lock:
            return {
                **self.counters,
                "host_bytes": self._host_bytes,
                "host_adapters": len(self._host),
                "resident_adapters": len(self._slot_of),
                "loads_in_flight": len(self._inflight),
            }

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._hash_pool.shutdown(wait=False, cancel_futures=True)

    # ---- internals ---------------------------------------------------------------------------

    def _pin(self, key: str, slot: int, waiter: Hashable) -> Acquired:
        ws = self._waiters.get(key)
        if ws is not None and waiter in ws:
            ws.discard(waiter)
            if not ws:
                del self._waiters[key]
        else:
            self.counters["hits"] += 1
        self._pins[key] = self._pins.get(key, 0) + 1
        self._slot_of.move_to_end(key)
        return Acquired(READY, slot=slot)

    def _evict(self, key: str) -> None:
        slot = self._slot_of.pop(key)
        self._sha_of.pop(key, None)
        self.runner.unload_adapter(slot)
        self.counters["evictions"] += 1

    def _place(self, host: HostAdapter) -> int | None:
        """Into the pool, evicting idle adapters (LRU) until a run of pages fits; None when it cannot now."""
        self._host.move_to_end(host.identity)
        idle = [k for k in self._slot_of if self._pins.get(k, 0) == 0]
        while True:
            t0 = time.perf_counter()
            try:
                slot = self.runner.load_adapter(host.weights, rank=host.rank, scale=host.scale, key=host.identity)
            except NoRoom:
                if not idle:
                    return None
                self._evict(idle.pop(0))
                continue
            self.counters["device_loads"] += 1
            self.counters["device_load_seconds"] += time.perf_counter() - t0
            self._slot_of[host.identity] = slot
            self._sha_of[host.identity] = host.sha256
            return slot

    def _load(self, ref: AdapterRef) -> HostAdapter:
        """Loader thread: `_read`, then give back the OpenMP team the checks may have made on this thread (the
        engine's should be the only one: inference_worker/openmp.py)."""
        try:
            return self._read(ref)
        finally:
            release_thread_team()

    def _read(self, ref: AdapterRef) -> HostAdapter:
        """Read, verify, parse, check. The hash runs beside the parse; the parse only reads
        the checked header and views the buffer, and nothing is used unless the hash matches."""
        t0 = time.perf_counter()
        try:
            blob = self.loader(ref.storage_key)
        except Exception as exc:  # storage errors of every kind fail the requests, not the worker
            raise AdapterLoadError(ErrorCode.ADAPTER_LOAD_FAILED, f"could not read {ref.storage_key!r}: {exc}") from exc
        digest = self._hash_pool.submit(lambda: hashlib.sha256(blob).hexdigest())
        weights: dict[str, torch.Tensor] | None = None
        try:
            weights = tensors_from_buffer(blob)
        except (SafetensorsError, TypeError, ValueError) as exc:
            parse_error: Exception = exc
        actual = digest.result()
        if actual != ref.sha256.lower():
            raise AdapterLoadError(
                ErrorCode.ADAPTER_INTEGRITY_ERROR,
                f"blob {ref.storage_key!r} has sha256 {actual[:12]}…, the adapter version expects {ref.sha256[:12]}…",
            )
        if weights is None:
            raise AdapterLoadError(ErrorCode.ADAPTER_LOAD_FAILED,
                                   f"blob {ref.storage_key!r} is not valid safetensors: {parse_error}")
        check_adapter_weights(weights, ref, self.shapes, self.max_rank)
        # Kept in the blob's dtype, as views of the blob: the pool copy converts as it copies, which
        # measured faster than converting here first (a bf16 -> fp32 copy reads half the bytes of fp32).
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        return HostAdapter(identity=ref.identity, sha256=ref.sha256, weights=weights, nbytes=nbytes, rank=ref.rank,
                           scale=ref.scale, load_seconds=time.perf_counter() - t0)

    def _finish_load(self, ref: AdapterRef, fut: Future) -> None:
        key = ref.identity
        with self._lock:
            self._inflight.pop(key, None)
            if fut.cancelled():
                return
            exc = fut.exception()
            if exc is None:
                host = fut.result()
                self.counters["load_seconds"] += host.load_seconds
                self._host[key] = host
                self._host_bytes += host.nbytes
                self._evict_host()
            else:
                if not isinstance(exc, AdapterLoadError):
                    exc = AdapterLoadError(ErrorCode.ADAPTER_LOAD_FAILED, f"loading {ref.storage_key!r} failed: {exc!r}")
                self.counters["load_failures"] += 1
                for w in self._waiters.pop(key, ()):
                    self._failed[w] = exc
        self.on_loaded()

    def _evict_host(self) -> None:
        """Oldest first, skipping adapters that requests wait to place into the pool."""
        if self._host_bytes <= self.host_cache_bytes:
            return
        for key in list(self._host):
            if self._host_bytes <= self.host_cache_bytes:
                break
            if key in self._waiters:
                continue
            host = self._host.pop(key)
            self._host_bytes -= host.nbytes
            self.counters["host_evictions"] += 1
