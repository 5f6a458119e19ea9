"""Choosing the next token and deciding when a request is done.

Two rules shape this module:
- A request's samples depend only on its own logits and its own seeded generator, never on which
  other requests share its batch: each sampled request owns a `torch.Generator`, consumed once per token.
- The per-step cost must stay small beside the forward pass: greedy rows of the whole batch are
  chosen with one `argmax`; only rows that really sample pay per-row work.

Stop strings are matched on the detokenized text, which grows token by token; a stop string may be split
across tokens, so the matcher re-searches the tail of the text, and streaming holds back any suffix that
could still become a stop string. The stop text itself is never part of the output.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from protocol.jobs import GenerationJob

# Temperatures below this sample as greedy (vLLM's _SAMPLING_EPS). A tiny but positive temperature would
# otherwise overflow logits / t to inf and the softmax to NaN; greedy is its limit anyway.
MIN_TEMPERATURE = 1e-5


class NonFiniteLogits(ValueError):
    """A row's logits hold NaN or inf (e.g. an adapter whose weights overflow): only that request fails."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @classmethod
    def from_job(cls, job: GenerationJob) -> "SamplingParams":
        return cls(temperature=float(job.temperature), top_p=float(job.top_p), top_k=int(job.top_k), seed=job.seed)

    def validate(self) -> str | None:
        """Why these parameters cannot be honoured, or None."""
        if not 0 <= self.temperature < float("inf"):  # also refuses NaN
            return "temperature must be a finite number >= 0"
        if not 0.0 < self.top_p <= 1.0:
            return "top_p must be in (0, 1]"
        if self.top_k < 0:
            return "top_k must be >= 0"
        return None


class RequestSampler:
    """Samples one request's tokens with its own generator (seeded: reproducible across runs and batches)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator(device="cpu")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.generator.manual_seed(int(seed))

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [vocab] (any device). Returns one token id."""
        p = self.params
        # fp32, temperature >= MIN_TEMPERATURE and finite logits: x stays finite, and softmax subtracts the max
        x = logits.detach().to("cpu", torch.float32) / max(p.temperature, MIN_TEMPERATURE)  # [vocab]
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


def sample_next_tokens(logits: torch.Tensor, samplers: list[tuple[int, RequestSampler]]
                       ) -> tuple[list[int], dict[int, Exception]]:
    """logits: [batch, vocab]; samplers: (row, sampler) for the rows that do not decode greedily.

    Every row is first decided by one argmax over the batch; sampled rows then overwrite theirs. Returns the
    tokens and, per failed row, why: a row whose logits are not all finite, or whose sampling raised, fails
    alone (its token is meaningless); the other rows of the batch are unaffected.
    """
    tokens = torch.argmax(logits, dim=-1).tolist()  # [batch]
    failed: dict[int, Exception] = {}
    finite = torch.isfinite(logits).all(dim=-1)  # [batch], one pass over the logits
    if not bool(finite.all()):
        for row in torch.nonzero(~finite).flatten().tolist():
            failed[row] = NonFiniteLogits("the model produced non-finite logits (NaN or inf) for this request; "
                                          "the adapter's weights or scale overflow the serving dtype")
    for row, sampler in samplers:
        if row in failed:
            continue
        try:
            tokens[row] = sampler.sample(logits[row])
        except Exception as exc:  # this request only
            failed[row] = exc
    return tokens, failed


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
