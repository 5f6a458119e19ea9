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
from typing import Any

_SOURCE = Path(__file__).parent / "csrc" / "sgmv_cpu.c"
_HEADERS = (Path(__file__).parent / "csrc" / "sgmv_units.h",
            Path(__file__).parent / "csrc" / "gemm_f32.h")  # included by _SOURCE: part of the cache key
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-pthread", "-fPIC"]  # compiling
# Linking, apart and without -ffast-math: given it, GCC 12 links crtfastmath.o into the shared object too, whose
# constructor sets flush-to-zero and denormals-are-zero in MXCSR when the library is loaded, for the loading thread
# and every thread it starts later (torch's ops, hypothesis' float strategies, the caller's own arithmetic).
_LINK_FLAGS = ["-shared", "-pthread", "-fPIC"]
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

_PREFILL_ATTN_ARGTYPES = (
    _i64, _p, _i64,  # n, q, q row stride
    _p, _i64,  # the layer's pages, page stride (elements)
    _p, _i64,  # the sequence's block table int64 [nb], start
    _p, _i64,  # out, row stride
    _i64, _i64, _i64, _i64, _i64,  # kv heads, g, hd, block size, window
    ctypes.c_float, ctypes.c_float, ctypes.c_int,  # scale, soft-cap (0: none), threads
)
_ATTN_ARGTYPES = (
    _i64, _p, _i64,  # B, q, q row stride
    _p, _i64,  # the layer's pages, page stride (elements)
    _p, _i64, _p,  # block table int64 [B, nb], nb, lens int64 [B]
    _p, _i64,  # out, row stride
    _i64, _i64, _i64, _i64, _i64,  # kv heads, g, head dim, block size, window
    ctypes.c_float, ctypes.c_float, ctypes.c_int,  # scale, soft-cap (0: none), threads
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


_SWIGLU_ARGTYPES = (
    _i64, _i64, _p, _i64,  # rows T, intermediate width n, gu [T, >= 2n], its row stride
    _p, _i64, ctypes.c_int,  # out [T, n], its row stride, threads
)
_GEMM_ARGTYPES = (
    _i64, _i64, _i64,  # rows M, in features K, out features N
    _p, _i64,  # x [M, K], its row stride
    _p, _p,  # the packed weight (gemm_pack_f32), bias [N] or NULL
    _p, _i64, ctypes.c_int, ctypes.c_int,  # out [M, N], its row stride, accumulate into out, threads
    _p, _p, _i64,  # the side stream to prefetch meanwhile: base, int64 [n][2] (byte offset, bytes), n; or NULL, NULL, 0
)
_GEMM_LORA_ARGTYPES = _GEMM_ARGTYPES[:11] + (
    _p, _i64,  # int64 [nproj][10]: each projection's fused LoRA term (kernels.cpu.FusedLoraGroup), nproj
    _p, _p, _i64,  # the layer's fp32 adapter buffer, scales fp32 [S], the shrink scratch's row stride
)
_ARGMAX_ARGTYPES = (
    _i64, _i64, _p, _i64,  # rows T, row length n, x [T, n], its row stride
    _p, ctypes.c_int,  # out int64 [T], threads
)


def _cache_dir() -> Path:
    default = Path(__file__).resolve().parent.parent / "var" / "kernels"
    return Path(os.environ.get("LORAFLEET_KERNELS_CACHE", default))


def _cpuinfo_first(*keys: str) -> list[str]:
    """The first CPU's /proc/cpuinfo lines that start with `keys` (none where it cannot be read)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    first = info.split("\n\n", 1)[0]
    return [ln for ln in first.splitlines() if ln.startswith(keys)]


def _cpu_fingerprint() -> str:
    return "\n".join(_cpuinfo_first("model name", "flags")[:2] or [platform.processor()])


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
        obj = tmp_path.with_suffix(".o")
        for extra in (_OPENMP_FLAGS, []):
            try:
                subprocess.run([compiler, *_FLAGS, *extra, "-c", "-o", str(obj), str(_SOURCE)],  # noqa: S603
                               check=True, capture_output=True, timeout=120)
                subprocess.run([compiler, *_LINK_FLAGS, *extra, "-o", str(tmp_path), str(obj), "-lm"],  # noqa: S603
                               check=True, capture_output=True, timeout=120)
                break
            except subprocess.CalledProcessError:
                if not extra:
                    raise
        os.replace(tmp_path, target)
    finally:
        tmp_path.unlink(missing_ok=True)
        tmp_path.with_suffix(".o").unlink(missing_ok=True)


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
        key = hashlib.sha256(source + " ".join(_FLAGS + _LINK_FLAGS + _OPENMP_FLAGS).encode()
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
        lib.paged_prefill_attention_f32.argtypes = _PREFILL_ATTN_ARGTYPES
        lib.paged_prefill_attention_f32.restype = ctypes.c_int
        lib.rms_norm_f32.argtypes = _RMS_ARGTYPES
        lib.rms_norm_f32.restype = None
        lib.rope_kv_write_f32.argtypes = _ROPE_ARGTYPES
        lib.rope_kv_write_f32.restype = ctypes.c_int
        lib.swiglu_f32.argtypes = _SWIGLU_ARGTYPES
        lib.swiglu_f32.restype = None
        lib.geglu_tanh_f32.argtypes = _SWIGLU_ARGTYPES
        lib.geglu_tanh_f32.restype = None
        lib.argmax_rows_f32.argtypes = _ARGMAX_ARGTYPES
        lib.argmax_rows_f32.restype = None
        lib.gemm_f32.argtypes = _GEMM_ARGTYPES
        lib.gemm_f32.restype = None
        lib.gemm_lora_f32.argtypes = _GEMM_LORA_ARGTYPES
        lib.gemm_lora_f32.restype = ctypes.c_int
        lib.gemm_pack_f32.argtypes = (_i64, _i64, _p, _i64, _p)
        lib.gemm_pack_f32.restype = None
        lib.gemm_f32_available.restype = ctypes.c_int
        _lib = lib
    return _lib


def sgmv_for(weight_dtype):
    """The native SGMV entry point for a weight buffer of `weight_dtype` (fp32, bf16, fp16; x and out fp32), or
    None when the library cannot be built or has none for that dtype."""
    return _sgmv.get(weight_dtype) if load() is not None else None


def paged_decode_attention(q, pages, blocks, lens, *, kv_heads: int, window: int | None, scale: float, threads: int,
                           softcap: float | None = None):
    """Decode attention read straight from the paged KV cache: q fp32 [B, H, hd] (one query per sequence),
    pages fp32 [P, 2 * kv_heads, block_size * hd] (a layer's pages, K heads then V heads), blocks int64
    [B, nb], lens int64 [B] (positions in the cache, the query's own included) -> [B, H * hd]; None when the
    native library or these shapes are not covered (the caller then gathers and uses SDPA). `softcap`: the
    scaled scores go through softcap * tanh(s / softcap) before the softmax (Gemma 2's attn_logit_softcapping)."""
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
        softcap or 0.0, threads)
    return out if rc == 0 else None


def paged_prefill_attention(q, pages, blocks, start: int, *, kv_heads: int, window: int | None, scale: float,
                            threads: int, softcap: float | None = None):
    """Prompt-chunk attention read straight from the paged KV cache: q fp32 [n, H, hd], the chunk's n queries at
    positions start..start+n-1 of one sequence (their keys already written), pages as for paged_decode_attention,
    blocks int64 [nb] the sequence's pages -> [n, H * hd], causal (and windowed); None when the native library or
    these shapes are not covered (the caller then gathers and uses SDPA). `softcap` as paged_decode_attention's."""
    import torch

    lib = load()
    n, H, hd = q.shape
    if (lib is None or q.dtype != torch.float32 or pages.dtype != torch.float32 or q.device.type != "cpu"
            or H % kv_heads or not pages.is_contiguous() or q.stride(2) != 1 or q.stride(1) != hd):
        return None
    blocks = blocks.contiguous()
    out = torch.empty(n, H * hd, dtype=q.dtype)
    bs = pages.shape[2] // hd
    rc = lib.paged_prefill_attention_f32(
        n, q.data_ptr(), q.stride(0), pages.data_ptr(), pages.stride(0), blocks.data_ptr(), start, out.data_ptr(),
        out.stride(0), kv_heads, H // kv_heads, hd, bs, window or 0, scale, softcap or 0.0, threads)
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


def _gated(entry: str, gu, n: int, threads: int):
    """The library's `entry` (swiglu_f32, geglu_tanh_f32) on fp32 rows gu [T, >= 2n] (gate columns, then up columns;
    each row contiguous) -> a new [T, n] tensor; None when the native library or this tensor is not covered."""
    import torch

    lib = load()
    if (lib is None or gu.dtype != torch.float32 or gu.device.type != "cpu" or gu.dim() != 2 or gu.stride(1) != 1
            or gu.shape[1] < 2 * n):
        return None
    out = torch.empty(gu.shape[0], n, dtype=gu.dtype)
    getattr(lib, entry)(gu.shape[0], n, gu.data_ptr(), gu.stride(0), out.data_ptr(), n, threads)
    return out


def swiglu(gu, n: int, *, threads: int):
    """SwiGLU's gate of fp32 rows gu [T, >= 2n] (gate columns, then up columns; each row contiguous):
    silu(gu[:, :n]) * gu[:, n:2n] in one pass -> a new [T, n] tensor; None when the native library or this
    tensor is not covered (the caller then uses torch ops)."""
    return _gated("swiglu_f32", gu, n, threads)


def geglu_tanh(gu, n: int, *, threads: int):
    """GeGLU's gate (Gemma's MLP, hidden_activation gelu_pytorch_tanh) of fp32 rows gu [T, >= 2n] as swiglu's:
    gelu_tanh(gu[:, :n]) * gu[:, n:2n] in one pass -> a new [T, n] tensor; None where swiglu's would be."""
    return _gated("geglu_tanh_f32", gu, n, threads)


def argmax_rows(x, *, threads: int):
    """Each row's first index of its largest value, for fp32 rows x [T, n] (each row contiguous, n >= 1) ->
    int64 [T], as torch.argmax(x, dim=-1) gives for rows without NaN (a row holding one gets some index inside
    it); None when the native library or this tensor is not covered (the caller then uses torch.argmax)."""
    import torch

    lib = load()
    if (lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1
            or x.shape[1] < 1):
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows_f32(x.shape[0], x.shape[1], x.data_ptr(), x.stride(0), out.data_ptr(), threads)
    return out


def gemm_available() -> bool:
    """Whether the native fp32 GEMM on packed weights (csrc/gemm_f32.h) runs here: the library builds, with AVX-512
    or with AVX2 and FMA."""
    lib = load()
    return lib is not None and bool(lib.gemm_f32_available())


def gemm_side_helps() -> bool:
    """Whether a GEMM prefetching a step's adapter lines into L2 while it multiplies is worth turning on by default
    here: on AMD CPUs. Both forms were measured paired in one process (bench/RESULTS.md). The side stream (GemmSide,
    bench/peers.py --lora-prefetch-ab, 2026-12-04): on a Zen 4 EPYC SmolLM2's fleet pass ran 1.04x (median of 7 rounds)
    with it; on an Intel Xeon guest (family 6 model 167, AVX-512 with AMX, 2 MB L2 a core) 0.89x (SmolLM2) and 0.97x
    (mid). The fused LoRA term (gemm_lora, each panel's B slices fetched while the panel multiplies; --fused-lora-ab,
    2026-12-06, against the calls after): on a Zen 3 EPYC 1.12x (SmolLM2) and 1.02x (mid), medians of 5; on that Intel
    Xeon 0.95x and 0.98x (medians of 3); on an Intel Xeon of model 207 1.02x (within its noise). Base-only passes alike
    either way."""
    return any("AuthenticAMD" in ln for ln in _cpuinfo_first("vendor_id"))


def _gemm_packed_elems(n: int, k: int) -> int:
    """Floats of a packed [n, k] weight: its panels' width rounded up to whole 16-float vectors (csrc/gemm_f32.h)."""
    return (n + 15) // 16 * 16 * k


def gemm_pack(weight):
    """A weight [N, K] (fp32, CPU, rows contiguous) packed for `gemm` -> a flat fp32 tensor; None when the native
    GEMM does not run here."""
    import torch

    lib = load()
    if (lib is None or not lib.gemm_f32_available() or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or weight.dim() != 2 or weight.stride(1) != 1):
        return None
    n, k = weight.shape
    packed = torch.empty(_gemm_packed_elems(n, k), dtype=torch.float32)
    lib.gemm_pack_f32(n, k, weight.data_ptr(), weight.stride(0), packed.data_ptr())
    return packed


def gemm(x, packed, n: int, bias=None, out=None, *, threads: int, side: tuple[int, int, int] | None = None):
    """x [M, K] @ W^T (+ bias) for W [n, K] packed by `gemm_pack`, into a new [M, n] tensor, or added to `out`
    [M, n] in place (the residual add) when it is given -> that tensor. x is made row-contiguous if it is not; out
    must be (its rows contiguous). Sums in fp32, each output element over k in order, then + bias, then + out.
    `side`: memory the caller reads next, prefetched a line at a time while the GEMM multiplies
    (`GemmSide.at(base)`)."""
    lib, x, out, acc = _gemm_operands("gemm", x, packed, n, out)
    m = x.shape[0]
    lib.gemm_f32(m, x.shape[1], n, x.data_ptr(), x.stride(0), packed.data_ptr(),
                  bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0), int(acc), threads,
                  *(side if side is not None else _NO_SIDE))
    return out


def _gemm_operands(name: str, x, packed, n: int, out):
    """The loaded library and `gemm`'s operands checked: x [M, K] fp32 against a packed [n, K] weight (made
    row-contiguous if it is not), out a new [M, n] fp32 tensor or the given one (the residual, rows contiguous) ->
    (lib, x, out, accumulate)."""
    import torch

    lib = _lib
    if lib is None:  # a packed weight exists only where gemm_pack loaded the library
        raise RuntimeError(f"{name}: the native kernel library is not loaded (gemm_pack packs the weights first)")
    if x.dim() != 2 or x.dtype != torch.float32 or packed.numel() != _gemm_packed_elems(n, x.shape[1]):
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype} does not fit a packed weight of {n} outputs")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    if out is None:
        return lib, x, torch.empty(m, n, dtype=torch.float32), False
    if out.shape != (m, n) or out.stride(1) != 1 or out.dtype != torch.float32:
        raise ValueError(f"{name}: out {tuple(out.shape)} is not [{m}, {n}] fp32 with contiguous rows")
    return lib, x, out, True


_NO_SIDE = (None, None, 0)
GEMM_LORA_MAX_ROWS = 1024  # csrc/gemm_f32.h GEMM_M_CHUNK: gemm_lora_f32 takes one pass over the weights


def gemm_lora(x, packed, n: int, bias, out, lora, buffer_ptr: int, *, threads: int):
    """`gemm` and the LoRA term of the GEMM's projections in one native call (csrc/gemm_f32.h, gemm_lora_f32):
    every segment's shrink, then the GEMM with each panel's expand right after it while the next slices of B come in.
    `lora`: a kernels.cpu.FusedLoraGroup built for x's rows; buffer_ptr: the layer's fp32 adapter buffer. x and out
    (when given, the residual) as `gemm` takes them -> out."""
    lib, x, out, acc = _gemm_operands("gemm_lora", x, packed, n, out)
    m = x.shape[0]
    if m != lora.rows or x.shape[1] != lora.d_in:
        raise ValueError(f"gemm_lora: x {tuple(x.shape)} does not fit a fused LoRA term of {lora.rows} rows x "
                         f"{lora.d_in} inputs")
    if lib.gemm_lora_f32(m, x.shape[1], n, x.data_ptr(), x.stride(0), packed.data_ptr(),
                         bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0), int(acc),
                         threads, lora.desc_ptr, lora.nproj, buffer_ptr, lora.scales_ptr, lora.sy) != 0:
        raise ValueError(f"gemm_lora: {m} rows is more than one pass of the native GEMM takes")
    return out


class GemmSide:
    """Byte ranges of one buffer that a GEMM prefetches while it multiplies (csrc/gemm_f32.h, gemm_side): what the
    caller reads right after it. At the decode batch the GEMM is bound by its arithmetic and leaves the memory bus
    mostly idle; the LoRA kernel after it is bound by its reads. `ranges`: (byte offset, byte length) pairs, kept by
    this object (the GEMM reads them through a pointer) and applied to any buffer's address with `at`."""

    __slots__ = ("_ranges", "_ptr", "_n")

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        flat = [v for r in ranges for v in r]
        self._ranges = (ctypes.c_int64 * len(flat))(*flat)
        self._ptr, self._n = ctypes.addressof(self._ranges), len(ranges)

    def at(self, base: int) -> tuple[int, int, int]:
        """`gemm`'s side argument: these ranges of the buffer at address `base` (each layer's, laid out alike)."""
        return (base, self._ptr, self._n)


class StepArena:
    """Where a runner's steps keep their small ops' outputs (StepKernels), from one step to the next: one fp32 buffer
    grown to the largest step seen, cut per step into R copies of the step's buffers, layer l writing copy l % R,
    with R = the model's layers where they fit in `cap_bytes` (a decode step), fewer where not (at least 1). The runner
    gives it protocol.memory.STEP_ARENA_BYTES, which its CPU workspace counts.

    Why copies: a buffer that both cores have just read, as both threads of the next GEMM read all of its input, sits
    in both cores' caches, and the next write to it must first take every line back from the other core. On the 2-vCPU
    Zen 4 guest that cost little while the host kept the two vCPUs close, and 5x in the phases (tens of seconds, on and
    off) where it put them apart: SwiGLU's output read by the down GEMM after it, one buffer for every layer, took
    206-224 us a call against 37-48 us with a buffer a layer (30 layers, SmolLM2's decode shapes; a ring of 8 held
    ~50 us at the median, 2 or 4 did not help; bench/RESULTS.md 2026-12-05). A copy written again only a step later has
    left the other core's caches by then."""

    __slots__ = ("_buf", "_carved", "cap_bytes")

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = int(cap_bytes)
        self._buf: Any = None  # a torch tensor once a step has asked
        self._carved: dict[tuple, list[list]] = {}  # the last few steps' shapes, cut already

    def carve(self, layers: int, widths: list[int], rows: int) -> list[list]:
        """R copies of [rows, width] fp32 buffers, one per width -> [copy][buffer]; R as the class says."""
        import torch

        key = (layers, tuple(widths), rows)
        hit = self._carved.get(key)
        if hit is not None:
            return hit
        per_copy = rows * sum(widths)
        copies = max(1, min(layers, self.cap_bytes // max(1, 4 * per_copy)))
        need = copies * per_copy
        if self._buf is None or self._buf.numel() < need:
            self._buf = torch.empty(need, dtype=torch.float32)
            self._carved.clear()  # views of the old buffer
        if len(self._carved) >= 16:
            self._carved.clear()
        out, at = [], 0
        for _ in range(copies):
            bufs = []
            for w in widths:
                bufs.append(self._buf[at:at + rows * w].view(rows, w))
                at += rows * w
            out.append(bufs)
        self._carved[key] = out
        return out


class StepKernels:
    """One forward step's native calls (CPU, fp32), with what every layer shares worked out once.

    Between its GEMMs a decoder layer runs a few small ops: RMSNorm, RoPE with the KV write, attention over the
    paged KV cache, SwiGLU's gate. Each GEMM streams megabytes of weights through the caches, so the call path of
    the op after it (Python, torch's tensor accessors and allocator, ctypes) starts cold: on this project's 2-CPU
    host the RMSNorm wrapper above took 143 us after a 48 MB read against 36 us warm, while the kernel itself,
    called on integers into an output allocated beforehand, took 40 us cold (bench/RESULTS.md). Here the step's
    activations (RMSNorm's output, q and k rotated, the attention's output, SwiGLU's output) are allocated once
    for all layers and the shapes checked once; each layer's call is one ctypes call on integers and the data
    pointers of the GEMMs' outputs. Where every prompt chunk of the step is short, the whole step attends in one
    call, prompt tokens included (each its own query over its sequence's pages), instead of an SDPA call per
    chunk.

    Every method returns one of the step's buffers, which a later layer's call of the same method overwrites (the
    layer's own copy, StepArena; at the latest the next layer's): a caller is done with it by then (a layer reads its
    norm's output in its GEMM and LoRA terms, and so on).
    `build` returns None where the library or the tensors are not covered; the caller then uses the wrappers
    above, or torch.
    """

    @classmethod
    def build(cls, *, rows: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
              block_size: int, eps: float, cos, sin_signed, write_rows, layer_pages: list,
              attend_blocks=None, attend_lens=None, scale: float = 1.0, threads: int = 1, layers: int = 1,
              arena: StepArena | None = None, softcap: float | None = None, local_cos=None,
              local_sin_signed=None) -> StepKernels | None:
        """cos, sin_signed [T, 1, hd] or [T, hd], write_rows int64 [T], layer_pages each layer's
        [P, 2 kv_heads, block_size * hd]; attend_blocks int64 [T, nb] and attend_lens int64 [T], every token's
        sequence's KV blocks and the positions it attends to (its own included), when every token of the step is
        to attend on the kernel (`attention` is then available). `arena` (StepArena, the runner's): where the step's
        buffers come from, a copy for each of `layers` layers where they fit; without one they are allocated for this
        step, one copy for all layers. `softcap`: the attention scores' soft-capping (Gemma 2), None none;
        `local_cos`, `local_sin_signed`: a second RoPE table at the same positions, for the layers that rotate with
        their own (Gemma 3's sliding layers: rope_kv(..., local=True))."""
        import torch

        lib = load()
        if (lib is None or head_dim % 2 or heads % kv_heads or not layer_pages
                or any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                       for t in (cos, sin_signed, *layer_pages))
                or cos.numel() != rows * head_dim or sin_signed.numel() != rows * head_dim
                or write_rows.dtype != torch.int64 or not write_rows.is_contiguous() or write_rows.numel() != rows
                or any(p.shape != layer_pages[0].shape for p in layer_pages)
                or layer_pages[0].shape[1:] != (2 * kv_heads, block_size * head_dim)):
            return None
        local = None
        if local_cos is not None and local_sin_signed is not None:
            if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                   or t.numel() != rows * head_dim for t in (local_cos, local_sin_signed)):
                return None
            local = (local_cos, local_sin_signed)
        attend = (attend_blocks is not None and attend_lens is not None
                  and attend_blocks.dtype == torch.int64 and attend_lens.dtype == torch.int64
                  and attend_blocks.is_contiguous() and attend_lens.is_contiguous()
                  and attend_blocks.shape[0] == rows and attend_lens.numel() == rows)
        return cls(lib, rows=rows, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads,
                   head_dim=head_dim, block_size=block_size, eps=eps, scale=scale, threads=threads, cos=cos,
                   sin_signed=sin_signed, write_rows=write_rows, layer_pages=layer_pages,
                   attend=(attend_blocks, attend_lens) if attend else None, layers=layers,
                   arena=arena if arena is not None else StepArena(0),  # 0: one copy, for this step
                   softcap=softcap, local=local)

    def __init__(self, lib: ctypes.CDLL, *, rows: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                 head_dim: int, block_size: int, eps: float, scale: float, threads: int, cos, sin_signed, write_rows,
                 layer_pages: list, attend: tuple | None, layers: int, arena: StepArena,
                 softcap: float | None = None, local: tuple | None = None) -> None:
        """What `build` checked; use `build`."""
        self.lib, self.T, self.hidden, self.inter = lib, rows, hidden, intermediate
        self.H, self.KV, self.hd, self.bs = heads, kv_heads, head_dim, block_size
        self.eps, self.scale, self.threads = float(eps), float(scale), int(threads)
        self.cap = float(softcap or 0.0)
        # per copy: the two norms' outputs, q and k rotated, SwiGLU's output, the attention's output (the same widths
        # as protocol.memory.step_arena_bytes counts in the workspace; kernels imports nothing of the project)
        widths = [hidden, hidden, (heads + kv_heads) * head_dim, intermediate] + ([heads * head_dim] if attend else [])
        self._copies = arena.carve(max(1, int(layers)), widths, rows)
        self._attends = attend is not None
        self._cos, self._sin, self._rows = cos.data_ptr(), sin_signed.data_ptr(), write_rows.data_ptr()
        self._pages = [p.data_ptr() for p in layer_pages]
        self._page_stride, self._num_pages = layer_pages[0].stride(0), layer_pages[0].shape[0]
        self._qkv_stride = (heads + 2 * kv_heads) * head_dim
        self._blocks = self._nb = self._lens = 0
        if attend is not None:
            self._blocks, self._nb, self._lens = attend[0].data_ptr(), attend[0].shape[1], attend[1].data_ptr()
        self._local = (local[0].data_ptr(), local[1].data_ptr()) if local is not None else None
        self._keep = (cos, sin_signed, write_rows, attend, layer_pages, local)  # what the pointers point into

    def _copy(self, layer: int) -> list:
        return self._copies[layer % len(self._copies)]

    def norm(self, x, weight, layer: int = 0, post: bool = False):
        """RMSNorm of the step's activations x [T, hidden] (contiguous) by weight [hidden] -> `layer`'s buffer for
        its input norm, or for its post-attention norm (`post`)."""
        h = self._copy(layer)[1 if post else 0]
        self.lib.rms_norm_f32(self.T, self.hidden, x.data_ptr(), self.hidden, weight.data_ptr(), h.data_ptr(),
                              self.hidden, self.eps, self.threads)
        return h

    def rope_kv(self, qkv, layer: int, local: bool = False):
        """RoPE and the KV write (rope_kv_write) of the fused q/k/v GEMM's output [T, q + 2 kv] (contiguous)
        into `layer`'s pages -> `layer`'s `qk` [T, heads + kv_heads, hd]. `local`: with the second table (`build`'s
        local_cos); None where there is none."""
        if local:
            if self._local is None:
                return None
            cos, sin = self._local
        else:
            cos, sin = self._cos, self._sin
        qk = self._copy(layer)[2]
        rc = self.lib.rope_kv_write_f32(self.T, qkv.data_ptr(), self._qkv_stride, self.H, self.KV, self.hd,
                                        cos, sin, self.hd, qk.data_ptr(), self._pages[layer],
                                        self._page_stride, self._num_pages, self._rows, self.bs, self.threads)
        if rc != 0:
            raise IndexError(f"a KV row is outside the layer's {self._num_pages} pages of {self.bs} positions")
        return qk.view(self.T, self.H + self.KV, self.hd)

    def attention(self, layer: int, window: int | None):
        """Attention of every token's rotated query (from rope_kv) over `layer`'s pages, where rope_kv has just
        stored the step's own keys and values -> `layer`'s `y` [T, heads * hd]. One query per token, each over
        its sequence's positions before it and its own (attend_lens): a decode token as decode attention does, a
        prompt token causally. None when `build` was given no attend tables or the shapes are beyond the
        kernel."""
        if not self._attends:
            return None
        copy = self._copy(layer)
        y = copy[4]
        rc = self.lib.paged_decode_attention_f32(
            self.T, copy[2].data_ptr(), (self.H + self.KV) * self.hd, self._pages[layer], self._page_stride,
            self._blocks, self._nb, self._lens, y.data_ptr(), self.H * self.hd, self.KV, self.H // self.KV,
            self.hd, self.bs, window or 0, self.scale, self.cap, self.threads)
        return y if rc == 0 else None

    def swiglu(self, gu, layer: int = 0):
        """SwiGLU's gate of the fused gate/up GEMM's output [T, 2 intermediate] (contiguous) -> `layer`'s `a`."""
        return self._gate(self.lib.swiglu_f32, gu, layer)

    def geglu(self, gu, layer: int = 0):
        """GeGLU's gate with the tanh GELU (geglu_tanh; Gemma's MLP), as `swiglu` -> `layer`'s `a`."""
        return self._gate(self.lib.geglu_tanh_f32, gu, layer)

    def _gate(self, entry, gu, layer: int):
        a = self._copy(layer)[3]
        entry(self.T, self.inter, gu.data_ptr(), 2 * self.inter, a.data_ptr(), self.inter, self.threads)
        return a
