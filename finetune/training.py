"""The training core: PEFT LoRA on a base checkpoint from OpenAI-style chat examples.

One function trains (`train_lora`); the trainer process (`manage.py run_trainer`), `demo_setup` and
bench/finetune.py all call it, so a customer's job and the demo's adapters are made by the same code.
Django-free on purpose: it takes parsed examples and a folder, and hands back a PEFT adapter folder.

What it does, and why:

- **Loss on assistant tokens only.** Each example is rendered with the base's own chat template, the
  way the serving path renders a chat; a token is a target when it lies inside an assistant turn whose
  `weight` is not 0: the turn's content and the template's end-of-turn token (so the adapter learns to
  stop), not the "<|im_start|>assistant\\n" header the template writes before it (that is the prompt at
  serving time), nor the whitespace after the end of the turn. The turns are found by rendering the
  conversation up to each assistant turn with `add_generation_prompt=True` (where the answer starts) and
  up to its end (where it stops), and mapping those character positions onto the tokens through the fast
  tokenizer's offsets. A template for which these renderings are not prefixes of one another cannot be
  masked this way, and is refused with a clear error rather than trained on a wrong mask.
- **Deterministic for a seed**: the LoRA init, the shuffling (one seeded generator, one permutation per
  epoch) and the arithmetic (deterministic algorithms, a fixed thread count) depend on the seed and the
  machine only; the same data, settings and seed give a byte-identical adapter on the same machine.
  No wall-clock budget: a run is its steps.
- **Cheap steps, same numbers.** The output layer (49k words on SmolLM2) is applied only where the
  loss is; rows are right-padded under causal attention (pads never reach a real token, so no mask is
  needed); and the tokens every example starts with (a template's default system prompt) run once per
  step and are shared by the batch through the key/value cache — with gradients, so loss and gradient
  are those of running each example whole (tests/finetune/test_training.py compares them).
- **bf16 autocast on CUDA, fp32 on CPU**; the LoRA weights and the optimizer stay fp32 on both.
- **Progress** goes to `on_event` ({"type": "metrics", ...} per logging step, {"type": "message", ...});
  `should_cancel()` is asked before every step and raises `Cancelled`.
- **Atomic output**: the adapter is written to a temporary folder beside `out_dir` and renamed into
  place, so a killed trainer never leaves a half-written adapter at `out_dir`.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_LOGGED_STEPS = 200  # at most about this many metrics events per run (every step on short runs)
TRAINER_VERSION = "lorafleet-train-1"  # recorded in a version's provenance; bump when the numbers would change
# Process-wide torch state (seeding, thread count, deterministic mode) is set under this lock, so that two
# runs started in one process (threads) do not interleave their seeding and LoRA init.
_SETUP_LOCK = threading.Lock()


class Cancelled(Exception):  # noqa: N818 (the name says what happened, as asyncio's CancelledError)
    """`should_cancel()` answered True between two steps; nothing was written to `out_dir`."""


@dataclass(frozen=True)
class TrainSettings:
    n_epochs: int
    batch_size: int
    learning_rate: float
    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    seed: int

    def check(self) -> None:
        problems = []
        if not (isinstance(self.n_epochs, int) and self.n_epochs >= 1):
            problems.append(f"n_epochs must be a whole number >= 1, got {self.n_epochs!r}")
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            problems.append(f"batch_size must be a whole number >= 1, got {self.batch_size!r}")
        if not (isinstance(self.learning_rate, int | float) and 0 < self.learning_rate < 1
                and math.isfinite(self.learning_rate)):
            problems.append(f"learning_rate must be a number in (0, 1), got {self.learning_rate!r}")
        if not (isinstance(self.rank, int) and self.rank >= 1):
            problems.append(f"rank must be a whole number >= 1, got {self.rank!r}")
        if not (isinstance(self.alpha, int | float) and self.alpha > 0):
            problems.append(f"alpha must be a positive number, got {self.alpha!r}")
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            problems.append(f"target_modules must name at least one module, got {self.target_modules!r}")
        if problems:
            raise ValueError("Unusable training settings: " + "; ".join(problems) + ".")


@dataclass
class TrainResult:
    adapter_dir: Path          # PEFT folder: adapter_config.json + adapter_model.safetensors
    steps: int
    trained_tokens: int        # tokens of the training examples (chat template included) x epochs
    train_loss: float          # mean loss over the last epoch's steps
    valid_loss: float | None   # mean per-token loss on the validation examples after training


# --- examples -> token ids and target masks ---------------------------------------------------------


@dataclass(frozen=True)
class Encoded:
    """One example: its token ids and, per token, whether it is a target (inside a weighted assistant turn)."""

    ids: tuple[int, ...]
    target: tuple[bool, ...]

    @property
    def first_target(self) -> int:
        return self.target.index(True)


@lru_cache(maxsize=4)
def _tokenizer(base_dir: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"The base at {base_dir} has no chat template: chat examples cannot be rendered for it.")
    if not tokenizer.is_fast:
        raise ValueError(f"The base at {base_dir} has no fast tokenizer: the assistant turns cannot be located.")
    return tokenizer


def _where(index: int) -> str:
    return f"example {index + 1} (line {index + 1} of its file)"


def _messages(example: object, index: int) -> list[dict]:
    """The example's messages, checked for the shape the chat template needs; ValueError naming what is wrong."""
    messages = example.get("messages") if isinstance(example, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{_where(index)}: expected an object with a non-empty \"messages\" list.")
    out = []
    for n, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            raise ValueError(f"{_where(index)}: message {n} is not an object.")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"{_where(index)}: message {n} has role {role!r}; expected one of {', '.join(ROLES)}.")
        if not isinstance(content, str):
            raise ValueError(f"{_where(index)}: message {n} ({role}) has no text \"content\".")
        weight = message.get("weight", 1)
        if role == "assistant" and weight not in (0, 1):
            raise ValueError(f"{_where(index)}: message {n} has weight {weight!r}; expected 0 or 1.")
        out.append({"role": role, "content": content, "weight": weight})
    return out


def _render(tokenizer, messages: list[dict], *, generation_prompt: bool) -> str:
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=generation_prompt)


def encode_example(tokenizer, example: dict, index: int = 0) -> Encoded:
    """Token ids of `example` rendered with the chat template, and its target mask (see the module docstring)."""
    messages = _messages(example, index)
    text = _render(tokenizer, messages, generation_prompt=False)
    spans = []  # character spans of the weighted assistant turns
    for n, message in enumerate(messages):
        if message["role"] != "assistant" or message["weight"] == 0:
            continue
        before = _render(tokenizer, messages[:n], generation_prompt=True) if n else ""
        through = _render(tokenizer, messages[:n + 1], generation_prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(f"{_where(index)}: the base's chat template does not render a conversation as the "
                             f"sum of its turns, so assistant turn {n + 1} cannot be located for the loss mask.")
        spans.append((len(before), len(through.rstrip())))
    if not spans:
        raise ValueError(f"{_where(index)}: no assistant message with weight 1, so there is nothing to learn from.")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    target = []
    for start, end in offsets:
        # A token belongs to a turn when it starts inside it (a zero-width token never does).
        target.append(end > start and any(s <= start < e for s, e in spans))
    if not any(target):
        raise ValueError(f"{_where(index)}: every weighted assistant message is empty; nothing to learn from.")
    if target[0]:
        raise ValueError(f"{_where(index)}: the first token cannot be a target (nothing comes before it).")
    return Encoded(tuple(ids), tuple(target))


def _encode_all(tokenizer, examples: Sequence[dict], context: int, what: str) -> list[Encoded]:
    if not examples:
        raise ValueError(f"The {what} data holds no examples.")
    out = []
    for index, example in enumerate(examples):
        encoded = encode_example(tokenizer, example, index)
        if len(encoded.ids) > context:
            raise ValueError(f"{what} {_where(index)}: {len(encoded.ids)} tokens with the chat template, more than "
                             f"the base's context of {context} tokens.")
        out.append(encoded)
    return out


def count_training_tokens(base_dir: Path, examples: list[dict]) -> list[int]:
    """Tokens per example with the base's chat template (what one epoch trains on); ValueError for a bad example."""
    tokenizer = _tokenizer(str(base_dir))
    return [len(encode_example(tokenizer, example, index).ids) for index, example in enumerate(examples)]


# --- the loss ---------------------------------------------------------------------------------------


def shared_prefix_length(encoded: Sequence[Encoded]) -> int:
    """Tokens every example starts with, leaving each example's first target predicted from outside the prefix."""
    first = encoded[0].ids
    n = min(e.first_target for e in encoded) - 1
    for e in encoded:
        n = next((i for i in range(n) if e.ids[i] != first[i]), n)
    return max(n, 0)


class _BatchLoss:
    """Mean cross-entropy over the target tokens of a batch, computed only where the targets are."""

    def __init__(self, model, *, prefix: Sequence[int], pad_id: int, device: torch.device) -> None:
        causal_lm = model.get_base_model()  # the transformers model, LoRA layers injected
        self.decoder, self.head = causal_lm.model, causal_lm.get_output_embeddings()
        self.prefix = torch.tensor(list(prefix), dtype=torch.long, device=device)  # [P]
        self.pad_id, self.device = pad_id, device

    def sums(self, batch: Sequence[Encoded]) -> tuple[torch.Tensor, int]:
        """(summed loss over the batch's target tokens, number of target tokens)."""
        p, b = self.prefix.numel(), len(batch)
        width = max(len(e.ids) for e in batch) - p
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)     # [B, W]
        targets = torch.full((b, width), -100, dtype=torch.long)        # [B, W]: the token each position predicts
        for row, e in enumerate(batch):
            seq = torch.tensor(e.ids[p:], dtype=torch.long)
            ids[row, :len(seq)] = seq
            wanted = torch.tensor(e.target[p + 1:], dtype=torch.bool)
            targets[row, :len(seq) - 1] = torch.where(wanted, seq[1:], -100)
        ids, targets = ids.to(self.device), targets.to(self.device)
        cache = None
        if p:
            # The shared prefix, once, with gradients; the batch reads its keys and values.
            cache = self.decoder(input_ids=self.prefix[None], use_cache=True).cache
            cache.batch_repeat_interleave(b)
        # Right padding under causal attention: pads never influence real tokens.
        hidden = self.decoder(input_ids=ids, cache=cache, use_cache=False).last_hidden_state  # [B, W, H]
        keep = targets != -100
        logits = self.head(hidden[keep]).float()  # [targets, V]
        n = int(keep.sum())
        return F.cross_entropy(logits, targets[keep], reduction="sum"), n


def _lr_at(progress: float, peak: float, warmup: float = 0.05) -> float:
    """Linear warm-up, then cosine to 10% of the peak; `progress` in [0, 1]."""
    if progress < warmup:
        return peak * max(progress / warmup, 0.05)
    t = min(1.0, (progress - warmup) / (1.0 - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


def default_threads() -> int:
    """The CPU threads a run uses: LORAFLEET_TRAIN_THREADS, else the machine's cores up to 8. Part of what makes
    a run reproducible (a different count sums in a different order)."""
    raw = os.environ.get("LORAFLEET_TRAIN_THREADS", "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"LORAFLEET_TRAIN_THREADS must be a whole number >= 1, got {raw!r}.")
        return int(raw)
    return max(1, min(8, os.cpu_count() or 1))


def _pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _autocast(device: torch.device):
    """bf16 autocast on CUDA (weights and LoRA stay fp32); nothing on the CPU, where training is fp32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _batches(n: int, batch_size: int, gen: torch.Generator) -> list[list[int]]:
    order = torch.randperm(n, generator=gen).tolist()
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def train_lora(base_dir: Path, train: list[dict], valid: list[dict] | None, settings: TrainSettings, out_dir: Path,
               *, on_event: Callable[[dict], None], should_cancel: Callable[[], bool],
               threads: int | None = None, device: str | None = None,
               pause: Callable[[], None] | None = None) -> TrainResult:
    """Train a LoRA adapter on `base_dir` from chat examples and write it (PEFT format) to `out_dir`.

    `train`/`valid`: parsed chat examples ({"messages": [...]}, optional `weight` 0|1 on assistant turns).
    `threads`: CPU threads (default `default_threads()`); `device`: "cpu", "cuda", ... (default: CUDA if any).
    Raises ValueError for unusable data or settings (naming the example and why), Cancelled when
    `should_cancel()` says so between steps; `out_dir` is only ever the complete adapter (replaced whole).
    `pause`: called before each decoder layer's forward and after each LoRA weight's gradient is accumulated (and
    before each step); it may block, to hold training while something else needs the cores (the trainer's
    transport.busy.YieldGate). Blocking changes when, not what, is computed.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    settings.check()
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    tokenizer = _tokenizer(str(base_dir))
    config = AutoConfig.from_pretrained(str(base_dir))
    context = int(getattr(config, "max_position_embeddings", 0) or 2048)
    train_enc = _encode_all(tokenizer, train, context, "training")
    valid_enc = _encode_all(tokenizer, valid, context, "validation") if valid else []
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dev = _pick_device(device)
    n_threads = threads or default_threads()
    on_event({"type": "message", "message": f"Training on {len(train_enc)} examples "
                                            f"({sum(len(e.ids) for e in train_enc)} tokens) for "
                                            f"{settings.n_epochs} epoch(s) on {dev.type}."})

    with _SETUP_LOCK:
        previous = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled())
        torch.set_num_threads(n_threads)
        torch.use_deterministic_algorithms(True, warn_only=True)
        if dev.type == "cuda":
            torch.backends.cudnn.benchmark = False
        torch.manual_seed(settings.seed)
        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        lora = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, target_modules=list(settings.target_modules),
                          lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        try:
            with warnings.catch_warnings():  # PEFT asks transformers a deprecated question; nothing for a user to do
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                model = get_peft_model(base, lora)
        except ValueError as exc:  # PEFT's "Target modules {...} not found in the base model"
            raise ValueError(f"LoRA target modules {list(settings.target_modules)} do not fit this base: {exc}") from None
        model.to(dev)
    handles = _hold_points(model, pause) if pause is not None else []
    try:
        return _run(model, tokenizer, train_enc, valid_enc, settings, out_dir, pad_id=pad_id, device=dev,
                    on_event=on_event, should_cancel=should_cancel, pause=pause)
    finally:
        for handle in handles:
            handle.remove()
        torch.set_num_threads(previous[0])
        torch.use_deterministic_algorithms(previous[1], warn_only=previous[2])


def _hold_points(model, pause: Callable[[], None]) -> list:
    """Where training may be held: before each decoder layer's forward (a module pre-hook) and as each trainable
    (LoRA) weight's gradient is accumulated in the backward pass (a post-accumulate-grad hook), i.e. every few tens of
    milliseconds of a CPU step. Neither hook touches a tensor. Returns the handles."""
    handles = [m.register_forward_pre_hook(lambda *_: pause()) for m in model.modules()
               if type(m).__name__.endswith("DecoderLayer")]
    handles += [p.register_post_accumulate_grad_hook(lambda _p: pause()) for p in model.parameters()
                if p.requires_grad]
    return handles


def _run(model, tokenizer, train_enc: list[Encoded], valid_enc: list[Encoded], settings: TrainSettings,
         out_dir: Path, *, pad_id: int, device: torch.device, on_event: Callable[[dict], None],
         should_cancel: Callable[[], bool], pause: Callable[[], None] | None = None) -> TrainResult:
    gen = torch.Generator().manual_seed(settings.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.learning_rate, betas=(0.9, 0.98), weight_decay=0.0)
    loss_of = _BatchLoss(model, prefix=train_enc[0].ids[:shared_prefix_length(train_enc)], pad_id=pad_id,
                         device=device)
    autocast = _autocast(device)
    per_epoch = math.ceil(len(train_enc) / settings.batch_size)
    total = per_epoch * settings.n_epochs
    every = max(1, math.ceil(total / MAX_LOGGED_STEPS))
    model.train()
    step, started = 0, time.perf_counter()
    last_epoch_losses: list[float] = []
    for epoch in range(settings.n_epochs):
        last_epoch_losses = []
        for picks in _batches(len(train_enc), settings.batch_size, gen):
            if pause is not None:
                pause()
            if should_cancel():
                raise Cancelled(f"cancelled before step {step + 1} of {total}")
            for group in opt.param_groups:
                group["lr"] = _lr_at(step / total, settings.learning_rate)
            with autocast:
                summed, n = loss_of.sums([train_enc[i] for i in picks])
            loss = summed / n
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            value = loss.item()
            if not math.isfinite(value):
                raise ValueError(f"The training loss became {value} at step {step}; try a lower learning rate.")
            last_epoch_losses.append(value)
            if step % every == 0 or step == total:
                on_event({"type": "metrics", "step": step, "total_steps": total, "train_loss": round(value, 6),
                          "epoch": epoch + 1, "elapsed_s": round(time.perf_counter() - started, 3)})
    model.eval()
    valid_loss = None
    if valid_enc:
        if should_cancel():
            raise Cancelled("cancelled before validation")
        valid_loss = evaluate(model, valid_enc, batch_size=settings.batch_size, pad_id=pad_id, device=device)
        on_event({"type": "message", "message": f"Validation loss {valid_loss:.4f} on {len(valid_enc)} examples."})
    if should_cancel():
        raise Cancelled("cancelled before the adapter was written")
    save_atomically(model, out_dir)
    train_loss = sum(last_epoch_losses) / len(last_epoch_losses)
    trained_tokens = sum(len(e.ids) for e in train_enc) * settings.n_epochs
    on_event({"type": "message", "message": f"Trained {step} steps, {trained_tokens} tokens, in "
                                            f"{time.perf_counter() - started:.1f} s; final train loss {train_loss:.4f}."})
    return TrainResult(adapter_dir=out_dir, steps=step, trained_tokens=trained_tokens, train_loss=train_loss,
                       valid_loss=valid_loss)


@torch.no_grad()
def evaluate(model, encoded: list[Encoded], *, batch_size: int, pad_id: int, device: torch.device) -> float:
    """Mean loss per target token over `encoded`, in file order."""
    loss_of = _BatchLoss(model, prefix=encoded[0].ids[:shared_prefix_length(encoded)], pad_id=pad_id, device=device)
    total, count = 0.0, 0
    with _autocast(device):
        for i in range(0, len(encoded), batch_size):
            summed, n = loss_of.sums(encoded[i:i + batch_size])
            total, count = total + float(summed), count + n
    return total / count


def save_atomically(model, out_dir: Path) -> None:
    """PEFT's save_pretrained into a temporary sibling folder, then renamed to `out_dir` (replacing it whole)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(str(tmp))
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
