"""Trains the demo's style adapters (and, offline, its tiny base) on the CPU, in seconds.

Why train at all: `make demo` must *show* that different tenants get different weights from one base.
Each adapter learns one visibly different answering style (demo/styles.py: shouty, lister, echo) with
PEFT LoRA, in the tokenizer's chat template, with the loss on the answer only — the shape of every
supervised fine-tune. Adapters are saved with PEFT's own ``save_pretrained``, so they are exactly the
files a customer would upload.

The demo base is SmolLM2-135M-Instruct (imported from GGUF, see adapters/gguf_import.py) when its
registry package is installed. Offline, a tiny Llama is built locally and first learns the shipped
corpus (short, regular English; see corpus/generate.py) for at most a minute: random weights produce
byte soup, and LoRA on top of byte soup is more byte soup.

Two things keep a step cheap on two CPU cores (a 135M-parameter model is ~0.2 GFLOP per token):

- every chat prompt begins with the same tokens (SmolLM2's template adds a default system prompt, a
  third of each example); their keys and values are computed once per step without gradients and
  shared by the batch, so the batch runs only the question and the answer;
- logits are computed only where the loss is (answer tokens): the 49k-word output layer is the
  costliest matmul per token.

Forward values are exactly those of the plain forward pass (the shared prefix is run through the
adapter too); only the gradient through the prefix's keys and values is left out.

Budgets are wall-clock caps above a floor of steps: the learning-rate schedule follows
``max(step/steps, min(elapsed/seconds, step/min_steps))``, so a slow machine still anneals before its
time is up, a fast one finishes its fixed number of steps — deterministic for a given seed whenever the
step count, not the clock, ends training — and a machine too busy for the clock still runs `min_steps`,
the fewest that show a style (an adapter that was not trained would show nothing).
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

from .styles import CORPUS_DIR, STYLES, style_examples
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


def _encode_examples(tokenizer, examples: Sequence[tuple[str, str]], max_len: int) -> list[tuple[list[int], int]]:
    """(token ids, index of the first answer token) per example; the loss is on the answer only.

    The prompt is tokenized as the serving path does it: the chat template rendered to text, then encoded.
    """
    out = []
    for question, answer in examples:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True, tokenize=False)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        out.append(((p_ids + a_ids)[:max_len], len(p_ids)))
    return out


def _shared_prefix_length(encoded: list[tuple[list[int], int]]) -> int:
    """Tokens every prompt starts with, leaving at least one prompt token per example to run with gradients."""
    first = encoded[0][0]
    n = min(answer_at for _, answer_at in encoded) - 1
    for ids, _ in encoded:
        n = next((i for i in range(n) if ids[i] != first[i]), n)
    return max(n, 0)


class _AnswerLoss:
    """The loss of one random batch of examples, on answer tokens only, with the shared prompt prefix
    run once without gradients (see the module docstring)."""

    def __init__(self, model, encoded: list[tuple[list[int], int]], *, batch_size: int, pad_id: int,
                 gen: torch.Generator) -> None:
        causal_lm = model.get_base_model()  # the transformers model, LoRA layers injected
        self.decoder, self.head = causal_lm.model, causal_lm.get_output_embeddings()
        self.encoded, self.batch_size, self.pad_id, self.gen = encoded, batch_size, pad_id, gen
        self.prefix_len = _shared_prefix_length(encoded)
        self.prefix = torch.tensor(encoded[0][0][:self.prefix_len])  # [P]

    def __call__(self) -> torch.Tensor:
        b, p = self.batch_size, self.prefix_len
        picks = torch.randint(0, len(self.encoded), (b,), generator=self.gen).tolist()
        rows = [(self.encoded[i][0][p:], self.encoded[i][1] - p) for i in picks]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)      # [B, W]
        targets = torch.full((b, width), -100, dtype=torch.long)         # [B, W]: the token after each position
        for row, (seq, answer_at) in enumerate(rows):
            ids[row, :len(seq)] = torch.tensor(seq)
            targets[row, answer_at - 1:len(seq) - 1] = torch.tensor(seq[answer_at:])
        cache = None
        if p:
            with torch.no_grad():
                cache = self.decoder(input_ids=self.prefix[None], use_cache=True).cache
            cache.batch_repeat_interleave(b)
        # Right padding under causal attention: pads never influence real tokens.
        hidden = self.decoder(input_ids=ids, cache=cache, use_cache=False).last_hidden_state  # [B, W, H]
        keep = targets != -100
        logits = self.head(hidden[keep]).float()  # [answer tokens, V]
        return F.cross_entropy(logits, targets[keep])


def train_style_adapter(base_dir: str | Path, out_dir: str | Path, style: str, *,
                        examples: Sequence[tuple[str, str]] | None = None, seconds: float = 20.0, seed: int = 0,
                        steps: int = 120, min_steps: int = 0, batch_size: int = 16, r: int = 8, alpha: float = 16.0,
                        lr: float = 5e-3,
                        target_modules: Sequence[str] = ALL_LINEAR, max_len: int = 64,
                        early: tuple[float, str | Path] | None = None, progress: bool = True,
                        on_step: Callable[[], None] | None = None, extra: dict | None = None) -> TrainReport:
    """Train a PEFT LoRA adapter on `base_dir` toward `style` and save it (PEFT format) to `out_dir`.

    `examples` are (question, styled answer) pairs (default: the tiny corpus' dialogues in `style`).
    `early` = (fraction, folder): the adapter as it was once that fraction of the run (of its steps or of
    its clock, whichever ends it) was done is saved there too, with its own training.json — the demo's
    earlier version of an adapter is the same run, stopped early. `on_step()` is called after every step
    (the demo draws one progress bar over runs in other processes with it).
    `extra` is recorded in every training.json written (the demo notes which base it was trained on).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; known: {', '.join(STYLES)}")
    _quiet_transformers()
    gen = _seed_everything(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    params = [p for p in model.parameters() if p.requires_grad]
    encoded = _encode_examples(tokenizer, style_examples(style) if examples is None else examples, max_len)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    loss_fn = _AnswerLoss(model, encoded, batch_size=batch_size, pad_id=pad_id, gen=gen)
    started = time.perf_counter()

    def report(ran: int, first: float, final: float, spent: float, cut: bool) -> TrainReport:
        return TrainReport(kind=f"adapter:{style}", seed=seed, steps=ran, planned_steps=steps,
                           seconds=round(spent, 2), budget_seconds=seconds, first_loss=round(first, 4),
                           final_loss=round(final, 4), cut_by_clock=cut,
                           extra={"r": r, "alpha": alpha, "target_modules": list(target_modules),
                                  "examples": len(encoded), "shared_prefix_tokens": loss_fn.prefix_len,
                                  **(extra or {})})

    def save(folder: str | Path, rep: TrainReport) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(folder))
        _write_report(folder, rep)

    early_saved = False

    def after_step(step: int, done: float, losses: list[float]) -> None:
        nonlocal early_saved
        if on_step is not None:
            on_step()
        if early is not None and not early_saved and done >= early[0]:
            tail = losses[-10:]
            save(early[1], report(step, losses[0], sum(tail) / len(tail), time.perf_counter() - started, False))
            early_saved = True

    ran, first, final, spent, cut = _train_loop(
        model, params, loss_fn, steps=steps, seconds=seconds, lr=lr, desc=f"train adapter {style}",
        progress=progress, after_step=after_step, min_steps=min_steps)
    final_report = report(ran, first, final, spent, cut)
    save(out_dir, final_report)
    return final_report
