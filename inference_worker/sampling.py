"""Choosing the next token and deciding when a request is done.

Two rules shape this module:
- A sequence's samples depend only on its own logits and its own seeded generator, never on which
  other requests share its batch: each sampled sequence owns a `torch.Generator`, consumed once per token.
  The n sequences of one request each get their own seed derived from the request's (`derived_seed`).
- The per-step cost must stay small beside the forward pass: greedy rows of the whole batch are
  chosen with one `argmax`; only rows that ask for more pay for it — logprobs (one log-softmax over the rows
  that ask), penalties and logit_bias (one sparse update over the (row, token) pairs they touch), sampling.

The order per row is vLLM's: logprobs are the log-softmax of the model's raw logits (before logit_bias,
penalties, temperature, top-k and top-p: what the model thinks, not what the sampler drew from); then
logit_bias, repetition_penalty, frequency and presence penalties; then greedy or temperature/top-k/top-p.

Stop strings are matched on the detokenized text, which grows token by token; a stop string may be split
across tokens, so the matcher re-searches the tail of the text, and streaming holds back any suffix that
could still become a stop string. The stop text itself is never part of the output.
"""
from __future__ import annotations

import hashlib
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kernels import argmax_rows
from protocol.jobs import GenerationJob

log = logging.getLogger(__name__)

# Temperatures below this sample as greedy (vLLM's _SAMPLING_EPS). A tiny but positive temperature would
# otherwise overflow logits / t to inf and the softmax to NaN; greedy is its limit anyway.
MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)
# The ranges in which no accepted combination makes a non-finite distribution (issue 47): a positive logit is
# divided by repetition_penalty (1e-38 would overflow float32), biases and penalties are added to logits.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range
MAX_ABS_PENALTY = 2.0  # presence_penalty and frequency_penalty (OpenAI's range)


class NonFiniteLogits(ValueError):
    """A row's logits hold NaN or inf (e.g. an adapter whose weights overflow): only that request fails."""


class SamplingFailed(RuntimeError):
    """Sampling a row raised: only that request fails, with this sentence (the library's text goes to the log,
    never into an answer)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k most likely

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @classmethod
    def from_job(cls, job: GenerationJob) -> SamplingParams:
        bias = tuple((int(t), float(b)) for t, b in (job.logit_bias or []))
        return cls(temperature=float(job.temperature), top_p=float(job.top_p), top_k=int(job.top_k), seed=job.seed,
                   presence_penalty=float(job.presence_penalty), frequency_penalty=float(job.frequency_penalty),
                   repetition_penalty=float(job.repetition_penalty), logit_bias=bias,
                   logprobs=None if job.logprobs is None else int(job.logprobs))

    def validate(self, vocab_size: int | None = None) -> str | None:
        """Why these parameters cannot be honoured, or None."""
        if not 0 <= self.temperature < float("inf"):  # also refuses NaN
            return "temperature must be a finite number >= 0"
        if not 0.0 < self.top_p <= 1.0:
            return "top_p must be in (0, 1]"
        if self.top_k < 0:
            return "top_k must be >= 0"
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_ABS_PENALTY <= getattr(self, name) <= MAX_ABS_PENALTY:  # also refuses NaN
                return f"{name} must be a number from {-MAX_ABS_PENALTY:g} to {MAX_ABS_PENALTY:g}"
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            return (f"repetition_penalty must be a number from {MIN_REPETITION_PENALTY:g} to "
                    f"{MAX_REPETITION_PENALTY:g} (1 = off)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            return f"logprobs must be in 0..{MAX_LOGPROBS}"
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            return "logit_bias names a token twice"
        for t, b in self.logit_bias:
            if not -MAX_ABS_LOGIT_BIAS <= b <= MAX_ABS_LOGIT_BIAS or (vocab_size is not None and not 0 <= t < vocab_size):
                return (f"logit_bias must map token ids in 0..{(vocab_size or 1) - 1} to numbers from "
                        f"{-MAX_ABS_LOGIT_BIAS:g} to {MAX_ABS_LOGIT_BIAS:g}")
        return None


def derived_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed`: choice 0 uses the seed itself (so n=1 and the
    first of n choices agree), the others a 63-bit hash of (seed, index), distinct per choice."""
    if index == 0:
        return int(seed)
    digest = hashlib.sha256(f"lorafleet-choice:{int(seed)}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class RequestSampler:
    """Samples one sequence's tokens with its own generator (seeded: reproducible across runs and batches)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator(device="cpu")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.generator.manual_seed(int(seed))

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [vocab] (any device). Returns one token id."""
        p = self.params
        # fp32, temperature >= MIN_TEMPERATURE and finite logits: x stays finite, and softmax subtracts the max
        t = max(p.temperature, MIN_TEMPERATURE)
        logits = logits.detach().to("cpu", torch.float32)
        x = logits / t  # [vocab]
        if not math.isfinite(float(x.max())):  # logits near float32's limit over a small temperature: shift first
            x = (logits - logits.max()) / t  # the same distribution; the largest is 0, the rest <= 0 or -inf
        vocab = x.shape[0]
        if 0 < p.top_k < vocab:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)  # [vocab]
            probs = torch.softmax(sorted_x, dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            drop[0] = False
            x = x.index_fill(0, order[drop], float("-inf"))
        probs = torch.softmax(x, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())


class SequenceSampling:
    """One sequence's sampling state: its sampler (None = greedy), what its penalties count, logprobs asked.

    Penalty state is sparse — the distinct tokens seen and their counts — so a step costs what the
    sequence has generated, never the vocabulary."""

    __slots__ = ("params", "sampler", "logprobs", "processed", "counts", "out_ids", "out_counts", "_pos", "rep_ids",
                 "_rep_seen")

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (), *, index: int = 0):
        if params.seed is not None and index:
            params = replace(params, seed=derived_seed(params.seed, index))
        self.params = params
        self.sampler = None if params.greedy else RequestSampler(params)
        self.logprobs = params.logprobs
        self.processed = params.penalized or bool(params.logit_bias)  # logits change before sampling
        self.counts = params.penalized  # keeps count of what it generates
        self.out_ids: list[int] = []  # distinct generated tokens, in first-seen order
        self.out_counts: list[int] = []
        self._pos: dict[int, int] = {}
        self.rep_ids: list[int] = []  # distinct prompt + generated tokens (repetition_penalty)
        self._rep_seen: set[int] = set()
        if params.repetition_penalty != 1:
            self._rep_seen = set(int(t) for t in prompt_ids)
            self.rep_ids = sorted(self._rep_seen)

    def observe(self, token: int) -> None:
        """The token this sequence took: counted for its penalties."""
        if not self.counts:
            return
        i = self._pos.get(token)
        if i is None:
            self._pos[token] = len(self.out_ids)
            self.out_ids.append(token)
            self.out_counts.append(1)
        else:
            self.out_counts[i] += 1
        if self.params.repetition_penalty != 1 and token not in self._rep_seen:
            self._rep_seen.add(token)
            self.rep_ids.append(token)


@torch.inference_mode()
def apply_processors(logits: torch.Tensor, states: list[SequenceSampling], skip=()) -> None:
    """logit_bias, then repetition_penalty, then frequency and presence penalties, in place, for the whole
    batch at once: each is one gather/scatter over the (row, token) pairs the rows touch.

    OpenAI: mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, c[j] = times token j was
    generated so far in this sequence. repetition_penalty (HF/vLLM): over prompt and generated tokens, a
    positive logit is divided by it and a negative one multiplied."""
    bias_r, bias_t, bias_v = [], [], []
    rep_r, rep_t, rep_p = [], [], []
    pen_r, pen_t, pen_v = [], [], []
    for row, st in enumerate(states):
        if not st.processed or row in skip:
            continue
        p = st.params
        if p.logit_bias:
            bias_r += [row] * len(p.logit_bias)
            bias_t += [t for t, _ in p.logit_bias]
            bias_v += [b for _, b in p.logit_bias]
        if p.repetition_penalty != 1 and st.rep_ids:
            rep_r += [row] * len(st.rep_ids)
            rep_t += st.rep_ids
            rep_p += [p.repetition_penalty] * len(st.rep_ids)
        if (p.frequency_penalty or p.presence_penalty) and st.out_ids:
            pen_r += [row] * len(st.out_ids)
            pen_t += st.out_ids
            pen_v += [c * p.frequency_penalty + p.presence_penalty for c in st.out_counts]
    dev = logits.device

    def index(rows, toks):
        return (torch.tensor(rows, dtype=torch.int64, device=dev), torch.tensor(toks, dtype=torch.int64, device=dev))

    if bias_r:
        logits.index_put_(index(bias_r, bias_t), torch.tensor(bias_v, dtype=logits.dtype, device=dev), accumulate=True)
    if rep_r:
        at = index(rep_r, rep_t)
        v, penalty = logits[at], torch.tensor(rep_p, dtype=logits.dtype, device=dev)
        # a finite logit divided by 0.01 may pass float32's largest: kept at it, so the row stays finite
        finite = torch.finfo(logits.dtype)
        logits[at] = torch.where(v > 0, v / penalty, v * penalty).clamp_(finite.min, finite.max)
    if pen_r:
        logits.index_put_(index(pen_r, pen_t), -torch.tensor(pen_v, dtype=logits.dtype, device=dev), accumulate=True)


@dataclass
class StepSample:
    tokens: list[int]
    failed: dict[int, Exception]  # row -> why (its token is meaningless)
    logprobs: dict[int, dict]  # row -> {"token", "logprob", "top": [[id, lp], ...]} for rows that ask


NON_FINITE = ("the model produced non-finite logits (NaN or inf) for this request; the adapter's weights or "
              "scale overflow the serving dtype")


def non_finite_rows(logits: torch.Tensor) -> list[int]:
    """Rows of `logits` [rows, vocab] holding a NaN or an infinity.

    One summing pass and a [rows] result: a row whose sum is finite holds neither (a NaN or an infinity makes the
    sum NaN or infinite). Only rows whose sum is not finite — those, or all-finite rows so large that the sum
    overflowed — are checked element by element. `torch.isfinite` over the whole batch instead wrote three
    full-size temporaries per step (abs, eq, ne: 12.6 MB each at 64 rows of a 49,152 vocabulary, ~8 ms per
    step in page faults alone)."""
    sums = logits.sum(dim=-1)
    suspect = torch.nonzero(~torch.isfinite(sums)).flatten()
    if suspect.numel() == 0:
        return []
    rows = logits.index_select(0, suspect)
    bad = ~torch.isfinite(rows).all(dim=-1)
    return suspect[bad].tolist()


GREEDY_NATIVE_MIN = 1 << 16  # logits below this many: torch.argmax (a small batch of a tiny vocabulary)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's first index of its largest logit: the native pass on CPU fp32 (torch.argmax took 1.3-2.5 ms a
    64-row SmolLM2 decode step, the native pass 0.47-0.52 ms; kernels.argmax_rows), torch.argmax elsewhere. Rows
    holding a NaN get some index; sample_step fails them before their token is read."""
    native = logits.numel() >= GREEDY_NATIVE_MIN
    picked = argmax_rows(logits, threads=torch.get_num_threads()) if native else None
    return (picked if picked is not None else torch.argmax(logits, dim=-1)).tolist()


@torch.inference_mode()
def sample_step(logits: torch.Tensor, states: list[SequenceSampling]) -> StepSample:
    """logits: [rows, vocab] fp32, one row per state (modified in place). One token per row.

    A row whose logits are not all finite, or whose sampling raised, fails alone; the other rows of the
    batch are unaffected. Rows that do not ask for logprobs, penalties or sampling cost one argmax."""
    failed: dict[int, Exception] = {row: NonFiniteLogits(NON_FINITE) for row in non_finite_rows(logits)}
    ask = [row for row, st in enumerate(states) if st.logprobs is not None and row not in failed]
    if ask:  # raw logprobs, before anything below changes the logits
        ask_idx = torch.tensor(ask, dtype=torch.int64, device=logits.device)
        lp = torch.log_softmax(logits.index_select(0, ask_idx), dim=-1)  # [A, vocab]
        k = min(max(states[row].logprobs or 0 for row in ask), logits.shape[-1])
        top = torch.topk(lp, k, dim=-1) if k else None
    if any(st.processed for st in states):
        apply_processors(logits, states, failed)
    tokens = greedy_tokens(logits)  # [rows]
    for row, st in enumerate(states):
        if st.sampler is None or row in failed:
            continue
        try:
            tokens[row] = st.sampler.sample(logits[row])
        except Exception as exc:  # this request only; torch's own words stay in the log
            log.exception("sampling a token failed")
            failed[row] = SamplingFailed("sampling the next token failed for this request")
            failed[row].__cause__ = exc
    entries: dict[int, dict] = {}
    if ask:
        chosen = torch.tensor([tokens[row] for row in ask], dtype=torch.int64, device=lp.device)
        chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        top_v, top_i = (top.values.tolist(), top.indices.tolist()) if top is not None else ([[]] * len(ask),) * 2
        for a, row in enumerate(ask):
            if row in failed:
                continue
            k = states[row].logprobs or 0
            entries[row] = {"token": tokens[row], "logprob": chosen_lp[a],
                            "top": [[i, v] for i, v in zip(top_i[a][:k], top_v[a][:k], strict=True)]}
    for row, st in enumerate(states):
        if st.counts and row not in failed:
            st.observe(tokens[row])
    return StepSample(tokens, failed, entries)


@torch.inference_mode()
def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[dict]:
    """Logprob entries of prompt tokens: `logits` [m, vocab] at the positions before them, `next_ids` [m] the
    tokens that followed. Raw log-softmax, as for generated tokens."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(next_ids, dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    if k:
        top = torch.topk(lp, k, dim=-1)
        top_v, top_i = top.values.tolist(), top.indices.tolist()
    else:
        top_v = top_i = [[]] * len(next_ids)
    return [{"token": t, "logprob": c, "top": [[i, v] for i, v in zip(ti, tv, strict=True)]}
            for t, c, ti, tv in zip(next_ids, chosen, top_i, top_v, strict=True)]


class IncrementalText:
    """Detokenizes a growing list of output tokens and finds stop strings across token boundaries.

    Uses the prefix-offset method (as in TGI/vLLM): decode a short window before and after the new
    token and take the difference, so the cost per token does not grow with the output, and a
    multi-byte character split across tokens is held until complete (the tokenizer shows it as U+FFFD).
    """

    CONTEXT_TOKENS = 5  # prompt tokens used as left context so leading-space rules decode as in the full text

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] | None = None):
        self.tokenizer = tokenizer
        # The Rust tokenizer behind a fast HF tokenizer decodes ~6x faster than the Python wrapper,
        # which matters at two decodes per token per request on the engine thread.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = backend.decode if backend is not None else None
        self.stop = [s for s in (stop or []) if s]
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = list(prompt_ids[-self.CONTEXT_TOKENS :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # the output text so far, without any stop string
        self.stopped = False  # a stop string was found; `text` ends right before it

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def append(self, token_id: int) -> bool:
        """Adds one output token; returns True when a stop string has appeared."""
        if self.stopped:
            return True
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # nothing printable yet (special token, or half a character)
        self._add_text(full[len(prefix) :])
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self.stopped

    def flush(self) -> None:
        """At the end of generation: keep whatever is still held back (e.g. an unfinished character)."""
        if self.stopped or self._read_offset >= len(self._ids):
            return
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix):
            self._add_text(full[len(prefix) :])
        self._prefix_offset = self._read_offset = len(self._ids)

    def _add_text(self, delta: str) -> None:
        start = len(self.text)
        self.text += delta
        if not self.stop:
            return
        # A stop string may begin up to len(stop)-1 characters before the new text.
        search_from = max(0, start - self._max_stop + 1)
        cut = -1
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            self.text = self.text[:cut]
            self.stopped = True

    def stable_text_len(self, finished: bool) -> int:
        """How much of `text` can be shown to a streaming client without ever being taken back."""
        if finished or self.stopped or not self.stop:
            return len(self.text)
        t = self.text
        for k in range(min(len(t), self._max_stop - 1), 0, -1):
            tail = t[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return len(t) - k
        return len(t)
