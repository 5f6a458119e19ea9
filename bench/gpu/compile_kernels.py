"""The SGMV kernels compiled ahead of time for a CUDA GPU on a machine without one: Triton's front end,
LLVM and the ptxas bundled in Triton's wheel take both kernels to a cubin for sm_<arch>, with the
constexpr combinations the launchers use for each dtype. Prints one JSON line (what was built, which
mma instructions the PTX uses). Run with TRITON_INTERPRET unset: interpreted kernels cannot be compiled.

    python bench/gpu/compile_kernels.py [ARCH]     # ARCH 90 (Hopper) by default
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    import triton

    try:
        import triton.backends.nvidia  # noqa: F401 — PyPI wheels ship it; without it there is nothing to target
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        print(json.dumps({"skipped": f"this Triton cannot compile for CUDA here: {exc}"}))
        return
    from kernels.triton_expand import _expand_kernel
    from kernels.triton_shrink import _shrink_kernel

    fp32_args, i64_args = {"y_ptr", "scales_ptr"}, {"a_offsets_ptr", "b_offsets_ptr"}
    built, mma = [], set()
    for dt, name in (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")):
        variants = [(_expand_kernel, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_R=16))]
        variants += [(_shrink_kernel, dict(BLOCK_M=16, BLOCK_R=r, BLOCK_K=64, SPLIT_K=k))
                     for r, k in ((16, 1), (64, 8))]
        for fn, consts in variants:
            consts = dict(consts, ALIGN=8 if dt != "fp32" else 4, FP32_IEEE=dt == "fp32", UPCAST_DOT=False)
            sig = {}
            for p in fn.params:
                if p.is_constexpr:
                    sig[p.name] = "constexpr"
                elif p.name.endswith("_ptr"):
                    sig[p.name] = ("*fp32" if p.name in fp32_args else "*i64" if p.name in i64_args
                                   else "*i32" if p.name.startswith(("ranks", "seg_")) else f"*{dt}")
                else:
                    sig[p.name] = "i32"
            kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                    target=GPUTarget("cuda", arch, 32))
            if not kernel.asm.get("cubin"):
                raise RuntimeError(f"{fn.__name__} ({dt}): no cubin")
            mma |= {ln.split()[0] for ln in kernel.asm["ptx"].splitlines() if ln.strip().startswith(("mma", "wgmma"))}
            built.append(f"{fn.__name__.strip('_')}/{name}/" + ",".join(f"{k}={v}" for k, v in consts.items()
                                                                       if k in ("BLOCK_R", "SPLIT_K")))
    print(json.dumps({"compiled": built, "mma": sorted(mma), "triton": triton.__version__, "arch": arch}))


if __name__ == "__main__":
    main()
