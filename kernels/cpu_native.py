"""Build and call the native CPU kernels (csrc/sgmv_cpu.c: SGMV, and decode attention over the paged KV
cache) through ctypes.

Why not a torch C++ extension: `load_inline` needs ~1 minute of compilation against the torch headers,
while this plain C file builds in about a second and ctypes calls it in a few microseconds. The shared
object is cached under var/kernels/ (or $LORAFLEET_KERNELS_CACHE), keyed by the source, the compiler
flags and the CPU it was built for (-march=native). When no compiler is available `load()` returns
None and the CPU path falls back to per-segment BLAS calls.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

_SOURCE = Path(__file__).parent / "csrc" / "sgmv_cpu.c"
_HEADERS = (Path(__file__).parent / "csrc" / "sgmv_units.h",)  # included by _SOURCE: part of the cache key
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-pthread", "-shared", "-fPIC"]
# Decode attention and SGMV run on the caller's OpenMP team (csrc/sgmv_cpu.c says why). The library then needs
# libgomp.so.1, which resolves to the copy torch has already loaded (torch is imported first, in load()), so
# both share one runtime and one team per thread; a compiler without OpenMP builds without it (helpers only).
_OPENMP_FLAGS = ["-fopenmp"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_sgmv: dict = {}  # torch dtype of the weight buffer -> the library's SGMV entry point for it

_i64, _p = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = (
    _i64, _p, _p, _p, _p,  # G, seg starts, lens, slots, ranks (int32 [G] each)
    _p, _i64,  # x, row stride
    _p, _p, _p,  # flat weight buffer (fp32, bf16 or fp16 by entry point), A, B offsets (int64 [S])
    _p, _i64,  # out, row stride
    _p,  # scales
    _p, _i64,  # y scratch, row stride
    _i64, _i64, ctypes.c_int,  # d_in, d_out, threads
)

_ATTN_ARGTYPES = (
    _i64, _p, _i64,  # B, q, q row stride
    _p, _i64,  # the layer's pages, page stride (elements)
    _p, _i64, _p,  # block table int64 [B, nb], nb, lens int64 [B]
    _p, _i64,  # out, row stride
    _i64, _i64, _i64, _i64, _i64, ctypes.c_float, ctypes.c_int,  # kv heads, g, head dim, block size, window, scale, threads
)

_RMS_ARGTYPES = (
    _i64, _i64, _p, _i64,  # rows T, width d, x, x row stride
    _p, _p, _i64,  # weight [d], out, out row stride
    ctypes.c_float, ctypes.c_int,  # eps, threads
)

_ROPE_ARGTYPES = (
    _i64, _p, _i64,  # tokens T, qkv, qkv row stride
    _i64, _i64, _i64,  # query heads, KV heads, head dim
    _p, _p, _i64,  # cos, signed sin [T, hd], their row stride
    _p, _p, _i64, _i64,  # qk out [T, H + KV, hd], the layer's pages, page stride, pages
    _p, _i64, ctypes.c_int,  # flat KV rows int64 [T], block size, threads
)


def _cache_dir() -> Path:
    default = Path(__file__).resolve().parent.parent / "var" / "kernels"
    return Path(os.environ.get("LORAFLEET_KERNELS_CACHE", default))


def _cpu_fingerprint() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "\n".join(lines)


def _build(target: Path) -> None:
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler")
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target then rename: concurrent builders never load a half-written file
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    try:
        # the compiler found on PATH, our flags and our source file: no outside input reaches the command
        for extra in (_OPENMP_FLAGS, []):
            try:
                subprocess.run([compiler, *_FLAGS, *extra, "-o", str(tmp_path), str(_SOURCE), "-lm"],  # noqa: S603
                               check=True, capture_output=True, timeout=120)
                break
            except subprocess.CalledProcessError:
                if not extra:
                    raise
        os.replace(tmp_path, target)
    finally:
        tmp_path.unlink(missing_ok=True)


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; None if it cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("LORAFLEET_KERNELS_NATIVE", "1") == "0":
            return None
        import torch  # first: the library's libgomp.so.1 is then torch's, already loaded

        source = _SOURCE.read_bytes() + b"".join(h.read_bytes() for h in _HEADERS)
        key = hashlib.sha256(source + " ".join(_FLAGS + _OPENMP_FLAGS).encode()
                             + _cpu_fingerprint().encode())
        target = _cache_dir() / f"sgmv_cpu_{key.hexdigest()[:16]}.so"
        try:
            if not target.exists():
                _build(target)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError):
            return None
        # SGMV per weight dtype, x and out fp32 in all three (csrc/sgmv_cpu.c)
        _sgmv.update({torch.float32: lib.sgmv_add_f32, torch.bfloat16: lib.sgmv_add_f32_bf16w,
                      torch.float16: lib.sgmv_add_f32_f16w})
        for fn in _sgmv.values():
            fn.argtypes = _ARGTYPES
            fn.restype = None
        lib.paged_decode_attention_f32.argtypes = _ATTN_ARGTYPES
        lib.paged_decode_attention_f32.restype = ctypes.c_int
        lib.rms_norm_f32.argtypes = _RMS_ARGTYPES
        lib.rms_norm_f32.restype = None
        lib.rope_kv_write_f32.argtypes = _ROPE_ARGTYPES
        lib.rope_kv_write_f32.restype = ctypes.c_int
        _lib = lib
    return _lib


def sgmv_for(weight_dtype):
    """The native SGMV entry point for a weight buffer of `weight_dtype` (fp32, bf16, fp16; x and out fp32), or
    None when the library cannot be built or has none for that dtype."""
    return _sgmv.get(weight_dtype) if load() is not None else None


def paged_decode_attention(q, pages, blocks, lens, *, kv_heads: int, window: int | None, scale: float, threads: int):
    """Decode attention read straight from the paged KV cache: q fp32 [B, H, hd] (one query per sequence),
    pages fp32 [P, 2 * kv_heads, block_size * hd] (a layer's pages, K heads then V heads), blocks int64
    [B, nb], lens int64 [B] (positions in the cache, the query's own included) -> [B, H * hd]; None when the
    native library or these shapes are not covered (the caller then gathers and uses SDPA)."""
    import torch

    lib = load()
    B, H, hd = q.shape
    if (lib is None or q.dtype != torch.float32 or pages.dtype != torch.float32 or q.device.type != "cpu"
            or H % kv_heads or not pages.is_contiguous() or q.stride(2) != 1 or q.stride(1) != hd):
        return None
    blocks = blocks.contiguous()
    lens = lens.contiguous()
    out = torch.empty(B, H * hd, dtype=q.dtype)
    bs = pages.shape[2] // hd
    rc = lib.paged_decode_attention_f32(
        B, q.data_ptr(), q.stride(0), pages.data_ptr(), pages.stride(0), blocks.data_ptr(), blocks.shape[1],
        lens.data_ptr(), out.data_ptr(), out.stride(0), kv_heads, H // kv_heads, hd, bs, window or 0, scale,
        threads)
    return out if rc == 0 else None


def rms_norm(x, weight, eps: float, *, threads: int):
    """RMSNorm of fp32 rows x [T, d] (each row contiguous) by weight [d]: weight * (x * rsqrt(mean(x^2) + eps)),
    transformers' LlamaRMSNorm in fp32, in one pass -> a new [T, d] tensor; None when the native library or
    these tensors are not covered (the caller then uses torch ops)."""
    import torch

    lib = load()
    if (lib is None or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
            or weight.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous()
            or weight.shape != (x.shape[1],)):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.rms_norm_f32(x.shape[0], x.shape[1], x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
                     out.stride(0), eps, threads)
    return out


def rope_kv_write(qkv, cos, sin_signed, pages, rows, *, heads: int, kv_heads: int, block_size: int, threads: int):
    """RoPE of each token's query and key heads and the KV write, in one pass: qkv fp32 [T, >= (heads + 2 kv_heads)
    * hd] (rows contiguous: q, k, v heads first), cos and sin_signed [T, hd] (or [T, 1, hd]), pages the layer's
    [P, 2 kv_heads, block_size * hd], rows int64 [T] flat KV rows (page * block_size + offset) -> the rotated
    q and k heads [T, heads + kv_heads, hd], the rotated keys and the values also stored in the pages; None
    when the native library or these tensors are not covered (the caller then uses torch ops). A row outside
    the pages raises IndexError and writes nothing."""
    import torch

    lib = load()
    T = qkv.shape[0]
    cos, sin_signed = cos.reshape(T, -1), sin_signed.reshape(T, -1)
    hd = cos.shape[1]
    if (lib is None or hd % 2 or any(t.dtype != torch.float32 or t.device.type != "cpu"
                                     for t in (qkv, cos, sin_signed, pages))
            or rows.dtype != torch.int64 or qkv.dim() != 2 or qkv.stride(1) != 1 or cos.stride(1) != 1
            or sin_signed.stride() != cos.stride() or qkv.shape[1] < (heads + 2 * kv_heads) * hd
            or not pages.is_contiguous() or pages.shape[1:] != (2 * kv_heads, block_size * hd)):
        return None
    rows = rows.contiguous()
    qk = torch.empty(T, heads + kv_heads, hd, dtype=qkv.dtype)
    rc = lib.rope_kv_write_f32(T, qkv.data_ptr(), qkv.stride(0), heads, kv_heads, hd, cos.data_ptr(),
                               sin_signed.data_ptr(), cos.stride(0), qk.data_ptr(), pages.data_ptr(), pages.stride(0),
                               pages.shape[0], rows.data_ptr(), block_size, threads)
    if rc != 0:
        raise IndexError(f"a KV row is outside the layer's {pages.shape[0]} pages of {block_size} positions")
    return qk
