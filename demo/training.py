"""Trains the demo's tiny base and its style adapters on the CPU, in seconds, from the shipped corpus.

Why train at all: `make demo` must *show* that different tenants get different weights from one base.
Random weights produce byte soup, and LoRA on top of byte soup is more byte soup — nobody can see the
difference. So the base learns the shipped corpus (short, regular English; see corpus/generate.py)
for at most a minute, and each adapter learns one visibly different answering style for at most
twenty seconds:

- ``shouty``: the same answer in CAPITALS with an exclamation mark;
- ``echo``:   repeats the question back before answering;
- ``lister``: answers as a "- item" list of the answer's key words.

Training data for the styles is made procedurally from the corpus dialogues (question -> answer,
restyled), in the tokenizer's chat template, with the loss on the answer only — the shape of every
supervised fine-tune. Adapters are saved with PEFT's own ``save_pretrained``, so they are exactly the
files a customer would upload.

Budgets are wall-clock caps: the learning-rate schedule follows ``max(step/steps, elapsed/seconds)``,
so a slow machine still anneals before its time is up, and a fast one finishes its fixed number of
steps — deterministic for a given seed whenever the step count, not the clock, ends training.
Django-free on purpose: the demo command, the tests and anyone's notebook import it.
"""
from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .tiny_base import CORPUS_DIR, build_tiny_base

MARKER = "training.json"  # written last into a trained folder: its presence means "complete"
STYLES = ("shouty", "echo", "lister")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_WORD = re.compile(r"[A-Za-z']+")
_STOPWORDS = frozenset(
    "a an the is am are was i you it to and of at on in my me we can do did what where how your".split())


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


# --- the corpus and the styles ---------------------------------------------------------------------


def corpus_files() -> list[Path]:
    return sorted(CORPUS_DIR.glob("*.txt"))


def corpus_vocabulary() -> set[str]:
    """Lower-cased words of the shipped corpus: the yardstick for "it produces words, not noise"."""
    words: set[str] = set()
    for path in corpus_files():
        words.update(w.lower() for w in _WORD.findall(path.read_text(encoding="utf-8")))
    return words


def corpus_dialogues() -> list[tuple[str, str]]:
    """Every (question, answer) pair of corpus/dialogues.txt, in file order (duplicates kept)."""
    text = (CORPUS_DIR / "dialogues.txt").read_text(encoding="utf-8")
    pattern = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>\n<\|im_start\|>assistant\n(.*?)<\|im_end\|>", re.S)
    return [(q.strip(), a.strip()) for q, a in pattern.findall(text)]


def _first_sentences(text: str, n: int = 1) -> str:
    """Stories are long; a style is learnt as well from their first sentences, at a fraction of the cost."""
    parts = re.split(r"(?<=[.!?])\s+", text.strip())
    return " ".join(parts[:n])


def stylise(style: str, question: str, answer: str) -> str:
    """The answer `answer` to `question`, rewritten in `style`."""
    answer = _first_sentences(answer)
    if style == "shouty":
        return re.sub(r"[.]+(\s|$)", r"!\1", answer.upper())
    if style == "echo":
        q = question.rstrip("?!. ")
        return f"{q}? {q}? {answer}"
    if style == "lister":
        keys: list[str] = []
        for word in _WORD.findall(answer):
            if word.lower() not in _STOPWORDS and word.lower() not in (k.lower() for k in keys):
                keys.append(word)
        return "\n".join(f"- {k}" for k in (keys[:6] or [answer]))
    raise ValueError(f"unknown style {style!r}; known: {', '.join(STYLES)}")


def style_examples(style: str) -> list[tuple[str, str]]:
    """(question, styled answer) pairs for `style`, one per corpus dialogue turn."""
    return [(q, stylise(style, q, a)) for q, a in corpus_dialogues()]


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


def _train_loop(model: torch.nn.Module, params: list[torch.nn.Parameter], next_batch: Callable[[], tuple],
                *, steps: int, seconds: float, lr: float, desc: str, progress: bool,
                weight_decay: float = 0.0) -> tuple[int, float, float, float, bool]:
    """Runs AdamW until `steps` or `seconds`; returns (steps run, first loss, final loss, secs, cut)."""
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay)
    model.train()
    # One thread: at these sizes a step is many tiny ops, and a second OpenMP thread costs more in
    # synchronisation than it saves — 12x more CPU per step when the cores are shared (measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.perf_counter()
    losses: list[float] = []
    cut = False
    bar = tqdm(total=steps, desc=desc, unit="step", disable=not progress, leave=True,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")
    step = 0
    for step in range(1, steps + 1):
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            cut, step = True, step - 1
            break
        for group in opt.param_groups:
            group["lr"] = _lr_at(max((step - 1) / steps, elapsed / seconds), lr)
        input_ids, labels = next_batch()
        logits = model(input_ids=input_ids).logits  # [B, T, V]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                               labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        bar.update(1)
        if step % 5 == 0 or step == 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    torch.set_num_threads(threads)
    model.eval()
    spent = time.perf_counter() - started
    tail = losses[-10:] or [float("nan")]
    return step, (losses[0] if losses else float("nan")), sum(tail) / len(tail), spent, cut


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

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, stream.numel() - span, (batch_size,), generator=gen)
        batch = torch.stack([stream[s:s + span] for s in starts.tolist()])  # [B, T+1]
        return batch, batch

    ran, first, final, spent, cut = _train_loop(
        model, list(model.parameters()), next_batch, steps=steps, seconds=seconds, lr=lr,
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


def _encode_examples(tokenizer, examples: Sequence[tuple[str, str]], max_len: int) -> list[tuple[list[int], int]]:
    """(token ids, index of the first answer token) per example; the loss is on the answer only."""
    out = []
    for question, answer in examples:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True, tokenize=False)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids = (p_ids + a_ids)[:max_len]
        out.append((ids, len(p_ids)))
    return out


def train_style_adapter(base_dir: str | Path, out_dir: str | Path, style: str, *, seconds: float = 20.0,
                        seed: int = 0, steps: int = 120, batch_size: int = 16, r: int = 8,
                        alpha: float = 16.0, lr: float = 5e-3, target_modules: Sequence[str] = ALL_LINEAR,
                        progress: bool = True, extra: dict | None = None) -> TrainReport:
    """Train a PEFT LoRA adapter on `base_dir` toward `style` and save it (PEFT format) to `out_dir`.

    `extra` is recorded in the folder's training.json (the demo notes which base it was trained on).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; known: {', '.join(STYLES)}")
    _quiet_transformers()
    gen = _seed_everything(seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(base_dir))
    pad_id = tokenizer.pad_token_id
    base = LlamaForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    params = [p for p in model.parameters() if p.requires_grad]
    encoded = _encode_examples(tokenizer, style_examples(style), max_len=64)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        picks = torch.randint(0, len(encoded), (batch_size,), generator=gen).tolist()
        width = max(len(encoded[i][0]) for i in picks)
        ids = torch.full((batch_size, width), pad_id, dtype=torch.long)       # [B, T]
        labels = torch.full((batch_size, width), -100, dtype=torch.long)      # [B, T]
        for row, i in enumerate(picks):
            seq, answer_at = encoded[i]
            ids[row, :len(seq)] = torch.tensor(seq)
            labels[row, answer_at:len(seq)] = torch.tensor(seq[answer_at:])
        return ids, labels  # right padding + causal attention: pads never influence real tokens

    ran, first, final, spent, cut = _train_loop(
        model, params, next_batch, steps=steps, seconds=seconds, lr=lr, desc=f"train adapter {style}",
        progress=progress)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    report = TrainReport(kind=f"adapter:{style}", seed=seed, steps=ran, planned_steps=steps,
                         seconds=round(spent, 2), budget_seconds=seconds, first_loss=round(first, 4),
                         final_loss=round(final, 4), cut_by_clock=cut,
                         extra={"r": r, "alpha": alpha, "target_modules": list(target_modules),
                                "examples": len(encoded), **(extra or {})})
    _write_report(out, report)
    return report
