"""Step 1 of bench/gpu_check.sh: the Triton SGMV kernels, compiled for the GPU (never interpreted), against
the float64 reference (kernels/reference.py) at Llama-2-7B shapes, in fp16, bf16 and fp32.

    python3 bench/gpu/check_kernels.py --out DIR            # CUDA; TRITON_INTERPRET must be unset
    python bench/gpu/check_kernels.py --rehearsal --out DIR # CPU, tiny shapes, Triton's interpreter

Layouts are the worker's: every adapter's A and B^T at random offsets of one flat pooled buffer with
garbage between them (kernels/testing.py), ranks 8..128 mixed, slots without weights in a projection
(rank 0), tokens without adapter (slot -1), 1..512 tokens over 1..64 adapters, offsets aligned to 16 bytes
and not, `out` alone and as a column view of a fused output. For every call: the result within the
dtype's tolerance of the reference, rows of tokens without weights and columns outside the view left
bit for bit, and (one case per dtype) NaN between the matrices changing nothing, which proves no load
reaches past a matrix. Then the precision of the expand itself on the device: y rounded once to tf32
and multiplied exactly (the arithmetic tests/kernels/test_expand_precision.py pins in the interpreter),
and an fp16 LoRA whose intermediate exceeds fp16's range staying finite.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.gpu.common import parse_args, require_device, run, sync  # noqa: E402

TOL = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 1e-4}  # relative to the largest |expected| value


@dataclass(frozen=True)
class Case:
    name: str
    runs: list  # (slot, tokens) in batch order; slot -1 = no adapter
    ranks: list  # rank per slot in the tables (0 = no weights in that projection)
    align: int  # 8: offsets on 16 bytes (vector loads); 1: any element
    fused: tuple = (0, 0)  # columns of a wider fused output left and right of `out`
    shapes: dict | None = None  # projection -> (d_in, d_out); None: the model's q/gate/down


def model_shapes(tiny: bool) -> dict:
    h, i = (32, 80) if tiny else (4096, 11008)
    if tiny:  # the rehearsal: the wide output and the wide input, fewer programs to interpret
        return {"gate_proj": (h, i), "down_proj": (i, h)}
    return {"q_proj": (h, h), "gate_proj": (h, i), "down_proj": (i, h)}


def cases(tiny: bool) -> list[Case]:
    ladder = [8, 16, 32, 64, 128]
    slots = 16 if tiny else 64  # the rehearsal keeps every kind of case, with fewer programs to interpret
    # rank per slot: the ladder, with every 9th slot holding no weights in the projection
    ranks = [0 if s % 9 == 4 else ladder[s % len(ladder)] for s in range(slots)]
    decode = [(s, 2) for s in range(slots // 2)]  # 64 decode tokens over 32 adapters (2 per adapter)
    big = 48 if tiny else 512
    prefill = [(3, big * 2 // 5), (-1, big // 12), (2, big // 2), (7, big - big * 2 // 5 - big // 12 - big // 2)]
    k = slots * 3 // 4  # single decode tokens, then prefill chunks and base tokens, then more decode tokens
    mixed = [(s, 1) for s in range(0, k)] + [(-1, 8), (k, 40), (k + 1, 1), (k + 2, 100 if not tiny else 20),
                                             (-1, 3), (k + 3, 16)]
    mixed += [(s, 1) for s in range(k + 4, slots)] + [(slots - 4, 4)]
    odd = (4099, 4101) if not tiny else (37, 45)
    return [
        Case(f"decode-{slots}tok-{slots // 2}ad", decode, ranks, align=8),
        Case("decode-1tok-r128-unaligned", [(0, 1)], [128] + [0] * 3, align=1),
        Case(f"prefill-{sum(n for _, n in prefill)}tok", prefill, ranks[:8], align=8),
        Case(f"mixed-{sum(n for _, n in mixed)}tok-{slots}ad-fused", mixed, ranks, align=8, fused=(16, 32)),
        Case("odd-widths-unaligned", [(1, 3), (-1, 2), (2, 17)], [5, 128, 33], align=1,
             shapes={"odd": odd}),
    ]


def compile_for_gpu(step, arch: int = 90) -> None:
    """Rehearsal only: both kernels compiled ahead of time for an sm_{arch} GPU by bench/gpu/compile_kernels.py
    (Triton's front end, LLVM and its bundled ptxas; no GPU needed), in a process of its own since this one
    interprets them."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(Path(__file__).with_name("compile_kernels.py")), str(arch)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)  # noqa: S603 — our script
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        step.check(f"compile_for_sm{arch}", False, (proc.stderr.strip().splitlines() or ["no output"])[-1])
        return
    res = json.loads(lines[-1])
    if res.get("skipped"):
        step.log(res["skipped"])
        return
    step.figure(compiled_for=f"sm_{arch}", compiled=res["compiled"], mma_instructions=res["mma"])
    step.check(f"compile_for_sm{arch}", len(res["compiled"]) == 9 and any(".tf32." in m for m in res["mma"]),
               f"{len(res['compiled'])} kernel variants to cubin (Triton {res['triton']}, no GPU); the "
               "half-precision expand runs on tf32 tensor cores")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    if args.rehearsal:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read by Triton when the kernels are decorated
    run("kernels", args, lambda step: body(step, args))


def body(step, args) -> None:
    import torch

    require_device(step)
    from kernels import LoraMapping, add_lora, lora_expand, lora_shrink
    from kernels.reference import add_lora_reference, expand_reference, shrink_reference
    from kernels.testing import random_pool

    dev, tiny = args.device, args.rehearsal
    if tiny:
        compile_for_gpu(step)
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    worst: dict[str, float] = {}
    calls = 0
    timings = {}

    def rel_err(got, want) -> float:
        scale = max(want.double().abs().max().item(), 1.0)
        return (got.double() - want.double()).abs().max().item() / scale

    for dtype in dtypes:
        dname = str(dtype).split(".")[-1]
        t_dtype = time.perf_counter()
        failures = []
        for ci, case in enumerate(cases(tiny)):
            shapes = case.shapes or model_shapes(tiny)
            token_slots = [s for s, n in case.runs for _ in range(n)]
            T = len(token_slots)
            for pi, (proj, (d_in, d_out)) in enumerate(shapes.items()):
                seed = 1000 * ci + 10 * pi + dtypes.index(dtype)
                pooled = random_pool({proj: (d_in, d_out)}, {proj: case.ranks}, dtype=dtype, seed=seed,
                                     align=case.align, max_gap=max(8, case.align), device=dev)
                buffer, table = pooled.buffer, pooled.tables[proj]
                g = torch.Generator().manual_seed(seed)
                x = torch.randn(T, d_in, generator=g).to(dtype).to(dev)
                scales = (torch.rand(len(case.ranks), generator=g) + 0.25).to(dev)
                left, right = case.fused
                fused = torch.randn(T, left + d_out + right, generator=g).to(dtype).to(dev)
                mapping = LoraMapping.build(torch.tensor(token_slots, dtype=torch.int32, device=dev),
                                            len(case.ranks))
                want = add_lora_reference(fused[:, left:left + d_out].clone(), x, buffer, table, mapping, scales)
                got_full = fused.clone()
                add_lora(got_full[:, left:left + d_out], x, buffer, table, mapping, scales, backend="triton")
                sync(dev)
                calls += 1
                got = got_full[:, left:left + d_out]
                err = rel_err(got, want)
                key = f"{dname}/{case.name}/{proj}"
                worst[key] = err
                if not torch.isfinite(got).all() or err > TOL[dname]:
                    failures.append(f"{key}: rel err {err:.2e} > {TOL[dname]:.0e}")
                skipped = [t for t, s in enumerate(token_slots) if s < 0 or case.ranks[s] == 0]
                if skipped and not torch.equal(got_full[skipped].view(torch.int16 if dtype != torch.float32
                                                                        else torch.int32),
                                               fused[skipped].view(torch.int16 if dtype != torch.float32
                                                                   else torch.int32)):
                    failures.append(f"{key}: a row without weights changed")
                outside = torch.cat([got_full[:, :left], got_full[:, left + d_out:]], dim=1)
                before = torch.cat([fused[:, :left], fused[:, left + d_out:]], dim=1)
                if outside.numel() and not torch.equal(outside, before):
                    failures.append(f"{key}: a column outside the output view changed")
                if ci == 0 and proj == "gate_proj":  # NaN between the matrices: nothing may read it
                    nan_pool = random_pool({proj: (d_in, d_out)}, {proj: case.ranks}, dtype=dtype, seed=seed,
                                           align=case.align, max_gap=max(8, case.align), device=dev,
                                           garbage=float("nan"))
                    got_nan = fused[:, left:left + d_out].clone()
                    add_lora(got_nan, x, nan_pool.buffer, nan_pool.tables[proj], mapping, scales, backend="triton")
                    if not torch.isfinite(got_nan).all() or rel_err(got_nan, want) > TOL[dname]:
                        failures.append(f"{key}: NaN between the matrices reached the result")
                if ci == 3 and proj == "gate_proj":  # the two halves on their own
                    y = lora_shrink(x, buffer, table, mapping, backend="triton")
                    y_ref = shrink_reference(x, buffer, table, mapping)
                    e_y = rel_err(y, y_ref)
                    worst[f"{key}/shrink"] = e_y
                    if e_y > TOL[dname]:
                        failures.append(f"{key}: shrink rel err {e_y:.2e}")
                    out0 = torch.randn(T, d_out, generator=g).to(dtype).to(dev)
                    e_x = rel_err(lora_expand(y_ref, buffer, table, mapping, out0.clone(), scales, backend="triton"),
                                  expand_reference(y_ref, buffer, table, mapping, out0.clone(), scales))
                    worst[f"{key}/expand"] = e_x
                    if e_x > TOL[dname]:
                        failures.append(f"{key}: expand rel err {e_x:.2e}")
        timings[dname] = round(time.perf_counter() - t_dtype, 2)
        dworst = max(v for k, v in worst.items() if k.startswith(dname + "/"))
        step.check(f"agree_with_float64_reference_{dname}", not failures,
                   (f"worst rel err {dworst:.2e} (tolerance {TOL[dname]:.0e}) over {len(cases(tiny))} layouts; "
                    f"rows without weights, columns outside the view and memory between matrices untouched")
                   if not failures else "; ".join(failures[:6]))

    step.figure(calls=calls, seconds_per_dtype_including_compile=timings,
                worst_rel_err={k: float(f"{v:.3e}") for k, v in worst.items()},
                shapes=model_shapes(tiny), cases=[c.name for c in cases(tiny)])

    # --- the expand's own precision on the device: y rounded to tf32 once, products exact ---------------
    h = model_shapes(tiny)["down_proj"][1]
    for dtype in (torch.bfloat16, torch.float16):
        dname = str(dtype).split(".")[-1]
        ranks = [16, 128, 40]
        pooled = random_pool({"p": (64, h)}, {"p": ranks}, dtype=dtype, seed=7, align=8, device=dev)
        buffer, table = pooled.buffer, pooled.tables["p"]
        slots = [0] * 5 + [1] * 17 + [-1] * 2 + [2] * 9
        mapping = LoraMapping.build(torch.tensor(slots, dtype=torch.int32, device=dev), len(ranks))
        g = torch.Generator().manual_seed(3)
        y = (torch.randn(len(slots), max(ranks), generator=g) * 3).to(dev)
        scales = torch.tensor([0.5, 2.0, 1.25], device=dev)
        got = lora_expand(y, buffer, table, mapping, torch.zeros(len(slots), h, device=dev), scales,
                          backend="triton").double()
        zeros = torch.zeros(len(slots), h, dtype=torch.float64, device=dev)
        tf32 = expand_reference(round_tf32(y).double(), buffer, table, mapping, zeros.clone(), scales)
        exact = expand_reference(y.double(), buffer, table, mapping, zeros.clone(), scales)
        bound = expand_reference(y.abs().double(), buffer.abs(), table, mapping, zeros.clone(), scales).max().item()
        e_tf32, e_exact = (got - tf32).abs().max().item() / bound, (got - exact).abs().max().item() / bound
        step.figure(**{f"expand_{dname}_err_vs_tf32_rounded_y": e_tf32, f"expand_{dname}_err_vs_exact_y": e_exact})
        # products exact, fp32 sums: a few ulps of the sum of |terms|; a y rounded to bf16 (or truncated to
        # tf32 by the hardware instead of rounded first) would be off by 2^-9 (2^-10) of it
        step.check(f"expand_{dname}_multiplies_y_rounded_to_tf32", e_tf32 <= 1e-5 and e_exact <= 2.0**-11 + 1e-5,
                   f"|got - B tf32(y)| = {e_tf32:.1e}, |got - B y| = {e_exact:.1e} of the sum of |terms| "
                   f"(<= 1e-5 and <= 2^-11 + 1e-5)")

    # fp16: an intermediate y beyond fp16's range (65504) must not overflow; the output itself fits
    d_in, ranks = 64, [8, 16]
    pooled = random_pool({"p": (d_in, h)}, {"p": ranks}, dtype=torch.float32, seed=1, align=8)
    buf32, table_cpu = pooled.buffer.clone(), pooled.tables["p"]
    for s in range(len(ranks)):
        table_cpu.a_of(buf32, s).mul_(200.0)
        table_cpu.b_of(buf32, s).mul_(1e-3)
    from kernels import LoraTable

    table = LoraTable.build(list(table_cpu.a_offset_list), list(table_cpu.b_offset_list), ranks, d_in=d_in,
                            d_out=h, device=dev)
    buffer = buf32.to(torch.float16).to(dev)
    slots = [0] * 4 + [1] * 5
    mapping = LoraMapping.build(torch.tensor(slots, dtype=torch.int32, device=dev), len(ranks))
    x = (torch.randn(len(slots), d_in, generator=torch.Generator().manual_seed(2)) * 60).to(torch.float16).to(dev)
    scales = torch.tensor([1.0, 0.5], device=dev)
    y_max = max((table.a_of(buffer, s).double() @ x[t].double()).abs().max().item() for t, s in enumerate(slots))
    want = add_lora_reference(torch.zeros(len(slots), h, dtype=torch.float16, device=dev), x, buffer, table,
                              mapping, scales)
    got = add_lora(torch.zeros(len(slots), h, dtype=torch.float16, device=dev), x, buffer, table, mapping, scales,
                   backend="triton")
    err = rel_err(got, want)
    step.figure(fp16_overflow_case={"max_abs_y": y_max, "max_abs_out": want.float().abs().max().item(),
                                    "rel_err": err})
    step.check("fp16_intermediate_beyond_65504_stays_finite",
               y_max > 65504 and bool(torch.isfinite(got).all()) and err <= TOL["float16"],
               f"max |y| {y_max:.0f}, result finite, rel err {err:.1e}")


def round_tf32(v):
    """fp32 -> the nearest tf32 value, ties to even (finite values), as fp32."""
    import torch

    bits = v.float().contiguous().view(torch.int32).to(torch.int64)
    return ((bits + ((bits >> 13) & 1) + 0xFFF) & ~0x1FFF).to(torch.int32).view(torch.float32)


if __name__ == "__main__":
    main()
