"""Trains the demo's tiny base on the CPU, offline, in about a minute; and writes the demo's style datasets.

Why train at all: `make demo` must *show* that different tenants get different weights from one base.
Each adapter learns one visibly different answering style (demo/styles.py: shouty, lister, echo). The
adapters themselves are trained by fine-tuning jobs, through the same trainer a customer's job runs
(finetune/trainer.py and finetune/training.py; see demo_setup): here are only their datasets, as chat
examples.

The demo base is SmolLM2-135M-Instruct (imported from GGUF, see adapters/gguf_import.py) when its
registry package is installed. Offline, a tiny Llama is built locally and first learns the shipped
corpus (short, regular English; see corpus/generate.py) for at most a minute: random weights produce
byte soup, and LoRA on top of byte soup is more byte soup.

The base's budget is a wall-clock cap above its planned steps: the learning-rate schedule follows
``max(step/steps, elapsed/seconds)``, so a slow machine still anneals before its time is up and a fast
one finishes its fixed number of steps (deterministic for a given seed whenever the step count, not the
clock, ends training).
Django-free on purpose: the demo command, the tests and anyone's notebook import it.
"""
from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from protocol.lora_layout import ATTENTION_MODULES, TARGET_MODULES

from .styles import CORPUS_DIR
from .tiny_base import build_tiny_base

MARKER = "training.json"  # written last into a trained folder: its presence means "complete"
ATTENTION, ALL_LINEAR = ATTENTION_MODULES, TARGET_MODULES

_WORD = re.compile(r"[A-Za-z']+")


@dataclass(frozen=True)
class BaseShape:
    """The demo base: big enough to learn the corpus in a minute, small enough to train in one."""

    hidden: int = 192
    layers: int = 3
    heads: int = 6
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 1024
    max_position: int = 512


@dataclass
class TrainReport:
    """What a training run did; written as ``training.json`` next to the weights."""

    kind: str                    # "base" or "adapter:<style>"
    seed: int
    steps: int                   # steps actually run
    planned_steps: int
    seconds: float               # wall-clock spent in the loop
    budget_seconds: float
    first_loss: float
    final_loss: float            # mean of the last few steps
    cut_by_clock: bool           # True when the time cap, not the step count, ended training
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# --- the corpus -----------------------------------------------------------------------------------


def corpus_files() -> list[Path]:
    return sorted(CORPUS_DIR.glob("*.txt"))


def corpus_vocabulary() -> set[str]:
    """Lower-cased words of the shipped corpus: the yardstick for "it produces words, not noise"."""
    words: set[str] = set()
    for path in corpus_files():
        words.update(w.lower() for w in _WORD.findall(path.read_text(encoding="utf-8")))
    return words


# --- shared training plumbing ----------------------------------------------------------------------


def _quiet_transformers() -> None:
    """Our own tqdm bars are the progress; hide transformers' per-load bars and a PEFT deprecation note."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def _seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def _lr_at(progress: float, peak: float, warmup: float = 0.05) -> float:
    """Linear warm-up, then cosine to 10% of the peak; `progress` in [0, 1]."""
    if progress < warmup:
        return peak * max(progress / warmup, 0.05)
    t = min(1.0, (progress - warmup) / (1.0 - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


def _train_loop(model: torch.nn.Module, params: list[torch.nn.Parameter], loss_fn: Callable[[], torch.Tensor],
                *, steps: int, seconds: float, lr: float, desc: str, progress: bool, weight_decay: float = 0.0,
                min_steps: int = 0,
                after_step: Callable[[int, float, list[float]], None] | None = None,
                ) -> tuple[int, float, float, float, bool]:
    """Runs AdamW on `loss_fn()` until `steps`, or `seconds` once `min_steps` ran; returns (steps run, first
    loss, final loss, secs, cut).

    `after_step(step, progress, losses so far)` runs after each optimizer step, `progress` in [0, 1] being
    the schedule's (the demo saves an early version of an adapter there).
    """
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay)
    model.train()
    # One thread: the demo trains two adapters at a time on two cores, and at the tiny base's sizes a
    # step is many tiny ops where a second OpenMP thread costs more in synchronisation than it saves —
    # 12x more CPU per step when the cores are shared (measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    min_steps = min(min_steps, steps)

    def done(step: int, elapsed: float) -> float:  # the schedule's progress, in [0, 1]
        by_clock = elapsed / seconds if not min_steps else min(elapsed / seconds, step / min_steps)
        return min(1.0, max(step / steps, by_clock))

    started = time.perf_counter()
    losses: list[float] = []
    cut = False
    bar = tqdm(total=steps, desc=desc, unit="step", disable=not progress, leave=True,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")
    step = 0
    for step in range(1, steps + 1):
        elapsed = time.perf_counter() - started
        if elapsed >= seconds and step > min_steps:
            cut, step = True, step - 1
            break
        for group in opt.param_groups:
            group["lr"] = _lr_at(done(step - 1, elapsed), lr)
        loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        bar.update(1)
        if step % 5 == 0 or step == 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if after_step is not None:
            after_step(step, done(step, time.perf_counter() - started), losses)
    bar.close()
    torch.set_num_threads(threads)
    model.eval()
    spent = time.perf_counter() - started
    tail = losses[-10:] or [float("nan")]
    return step, (losses[0] if losses else float("nan")), sum(tail) / len(tail), spent, cut


def _causal_lm_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token loss over every position of `input_ids` [B, T]."""
    logits = model(input_ids=input_ids).logits  # [B, T, V]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1))


def _write_report(folder: Path, report: TrainReport) -> None:
    tmp = folder / (MARKER + ".tmp")
    tmp.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    tmp.replace(folder / MARKER)


def read_report(folder: str | Path) -> dict | None:
    """The training report of a folder, or None if it was never (completely) trained."""
    path = Path(folder) / MARKER
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- the base --------------------------------------------------------------------------------------


_ANSWER = re.compile(r"(<\|im_start\|>assistant\n)(.*?)(<\|im_end\|>)", re.S)


def _shout(doc: str) -> str:
    """The document in capitals, chat markup left intact (its special tokens are case-sensitive)."""
    if "<|im_start|>" in doc:
        return _ANSWER.sub(lambda m: m.group(1) + m.group(2).upper() + m.group(3), doc)
    return doc.upper()


def corpus_documents(*, shout_fraction: float = 0.0, seed: int = 0) -> list[str]:
    """The corpus split into documents (blank-line separated), shuffled, a fraction of them in capitals.

    Why capitals: the tokenizer learnt lower-case words, so "THE BALL" is one token per letter. A LoRA
    cannot learn to spell every word in twenty seconds, but it can learn to *switch* to a register the
    base already knows — so the base reads a few shouted documents, as any web-trained base has.
    """
    docs: list[str] = []
    for path in corpus_files():
        docs.extend(d.strip() for d in path.read_text(encoding="utf-8").split("\n\n") if d.strip())
    rng = random.Random(seed)
    rng.shuffle(docs)  # interleave stories and dialogues so every window sees both
    return [_shout(d) if rng.random() < shout_fraction else d for d in docs]


def _corpus_token_ids(tokenizer, *, shout_fraction: float, seed: int) -> torch.Tensor:
    """The corpus as one token stream, ChatML special tokens intact."""
    text = "\n\n".join(corpus_documents(shout_fraction=shout_fraction, seed=seed))
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def train_base(out_dir: str | Path, *, seconds: float = 60.0, seed: int = 0, shape: BaseShape = BaseShape(),
               steps: int = 600, batch_size: int = 16, seq_len: int = 64, lr: float = 1e-2,
               shout_fraction: float = 0.1, progress: bool = True) -> TrainReport:
    """Build a tiny Llama checkpoint in `out_dir` and train it on the corpus for at most `seconds`.

    The folder stays a plain Hugging Face checkpoint (the weights are overwritten in place as
    safetensors); ``training.json`` is written last and marks it complete.
    """
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    _quiet_transformers()
    out = Path(out_dir)
    (out / MARKER).unlink(missing_ok=True)
    build_tiny_base(out, arch="llama", seed=seed, hidden=shape.hidden, layers=shape.layers, heads=shape.heads,
                    kv_heads=shape.kv_heads, intermediate=shape.intermediate, vocab=shape.vocab,
                    max_position=shape.max_position)
    gen = _seed_everything(seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    # The builder's init keeps activations O(1) for parity tests; for training, the usual small init
    # (std 0.02, zero-mean residual writes) learns much faster in a few hundred steps.
    _reinit_for_training(model, gen)
    stream = _corpus_token_ids(tokenizer, shout_fraction=shout_fraction, seed=seed)  # [N]
    span = seq_len + 1

    def loss_fn() -> torch.Tensor:
        starts = torch.randint(0, stream.numel() - span, (batch_size,), generator=gen)
        return _causal_lm_loss(model, torch.stack([stream[s:s + span] for s in starts.tolist()]))  # [B, T+1]

    ran, first, final, spent, cut = _train_loop(
        model, list(model.parameters()), loss_fn, steps=steps, seconds=seconds, lr=lr,
        desc="train demo base", progress=progress, weight_decay=0.01)
    model.save_pretrained(str(out), safe_serialization=True)
    report = TrainReport(kind="base", seed=seed, steps=ran, planned_steps=steps, seconds=round(spent, 2),
                         budget_seconds=seconds, first_loss=round(first, 4), final_loss=round(final, 4),
                         cut_by_clock=cut, extra={"shape": asdict(shape), "batch_size": batch_size,
                                                  "seq_len": seq_len, "shout_fraction": shout_fraction,
                                                  "corpus_tokens": int(stream.numel())})
    _write_report(out, report)
    return report


def _reinit_for_training(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        n_layers = model.config.num_hidden_layers
        for name, p in model.named_parameters():
            if p.ndim == 1:  # RMSNorm weights
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02 / math.sqrt(2 * n_layers))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def base_is_trained(folder: str | Path) -> bool:
    """A complete trained base: the marker, the config and the weights are all there."""
    folder = Path(folder)
    report = read_report(folder)
    return (report is not None and report.get("kind") == "base"
            and (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
            and (folder / "tokenizer.json").is_file())


# --- the style adapters ----------------------------------------------------------------------------


def chat_examples(pairs: Sequence[tuple[str, str]]) -> list[dict]:
    """(question, styled answer) pairs as OpenAI chat fine-tuning examples: what the demo uploads as a training
    file and trains through a fine-tuning job (finetune/training.py), as a customer would."""
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs]
