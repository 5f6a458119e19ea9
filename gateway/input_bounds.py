"""Bounds on a request's inputs, checked before the expensive work they would cause (issue 47).

A prompt is refused for its size before anything tokenizes it, and what may fit is tokenized only as far
as it takes to know: a tenant who sends megabytes pays a few milliseconds of the web's CPU, not seconds.

- The byte bound. No tokenizer makes fewer tokens than ceil(bytes / B), where B is the most input bytes
  one of its tokens can stand for: the longest token of its vocabulary (in the bytes it decodes to; added
  tokens by their text). It holds for the BPE tokenizers the served families use (byte-level: Llama 3,
  Qwen2, SmolLM2; SentencePiece-style with byte fallback: Llama 2, Mistral, Gemma), as long as nothing
  before the model deletes text: a normalizer outside the few that only add or widen text is applied
  first (bytes are counted after it), and a pre-tokenizer that drops text (BERT's whitespace splitter),
  a word-level or unigram model, unknown-token fusion without byte fallback or an added token that
  swallows the spaces beside it leave no bound (B is None). Computed once per tokenizer.
- Sliced counting. Text the byte bound lets through is tokenized in slices of SLICE_CHARS characters cut
  before a space that follows a non-space and precedes a letter — a piece boundary for every regex
  pre-tokenizer of those families (GPT-2's, Llama 3's, Qwen2's, Metaspace), so the slices' tokens add up to
  the whole text's — and counting stops once the sum, less a slack per seam, is over the budget: about
  budget + 1 tokens of work whatever the text's size. Text that may fit is then tokenized whole, so the
  count that decides is exact and nothing that fits is ever refused.
- Lists and strings that need no tokenizer (messages, stop strings) have fixed caps, checked in order.
- One large body at a time per API key and per tenant (`LargeBodyTurn`): reading, parsing, binding and
  measuring a body of megabytes holds the web process's interpreter for milliseconds; a tenant sending many at
  once waits for its own turns instead of taking the process from every other tenant (and its bodies wait in
  the socket, not in the web's memory), and it waits without a database connection: the process's pool is for
  every tenant. Turns are also paced: after a turn that took t seconds, the key's and the tenant's next one
  starts no sooner than LARGE_BODY_REST * t later, so that one tenant's large bodies take at most about half
  of a web process's time, not all of it (issue 47, tests/reliability/test_megabyte_prompts.py on the shared
  2-core box: another tenant's latency during waves of 60 concurrent 2 MB prompts 1.29-1.82x its solo value
  in seven runs with the rest, 1.71-2.57x in five without).
"""
from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from django.db import connection

from .errors import ApiError, invalid

SLICE_CHARS = 16_384
SEAM_SEARCH_CHARS = 2_048  # how far back from a slice's end a soft cut is looked for
SOFT_SEAM_SLACK = 4  # tokens a seam at a piece boundary may add (a prepended "▁"): 0 on byte-level tokenizers
HARD_SEAM_SLACK = 16  # tokens a cut inside a word may add, plus the longest added token's length (a split one)
MAX_MESSAGES = 2_048  # OpenAI's own limit on `messages`
MAX_STOP_CHARS = 1_000  # one stop string; the output it would have to match is far shorter in practice
LARGE_BODY_BYTES = 256 * 1024  # a body this large waits for its turn (LargeBodyTurn)
LARGE_BODY_REST = 1.0  # after a turn of t seconds, the key's and the tenant's next turn waits this * t more
LARGE_BODY_MAX_REST_S = 1.0  # never longer than this (a turn that loaded a tokenizer took seconds)
_TURN_STRIPES = 64  # locks shared by tenant id modulo this: bounded memory, rarely two tenants on one


class TooLong(Exception):
    """The text has more tokens than the budget: at least `tokens` (exactly, when `exact`)."""

    def __init__(self, tokens: int, *, exact: bool = False):
        super().__init__(tokens)
        self.tokens, self.exact = tokens, exact


@dataclass(frozen=True)
class TokenizerFacts:
    """What the bounds need to know of one tokenizer, computed once (see tokenizer_facts)."""

    max_bytes_per_token: int | None  # None: no sound byte bound for this tokenizer
    normalizer_safe: bool  # the normalizer only adds or widens text: raw bytes bound the normalized ones
    longest_added: int  # characters of the longest added token
    backend: object  # the tokenizers.Tokenizer behind the transformers one
    text_backend: object  # a copy that encodes special-token strings as ordinary text (gateway/prompt_text.py)
    specials: dict[str, int]  # special tokens' text -> id


_facts: dict[int, tuple[object, TokenizerFacts]] = {}
_facts_lock = threading.Lock()

# Normalizers that never shrink text: every input byte is still there after them.
_WIDENING_NORMALIZERS = {"Prepend", "Replace"}
# Pre-tokenizers that keep every byte of their input in some piece.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


def tokenizer_facts(tokenizer) -> TokenizerFacts:
    """The facts of a transformers fast tokenizer, cached for its lifetime (the web caches tokenizers per base)."""
    entry = _facts.get(id(tokenizer))
    if entry is not None and entry[0] is tokenizer:
        return entry[1]
    with _facts_lock:
        entry = _facts.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            entry = (tokenizer, _compute_facts(tokenizer))
            _facts[id(tokenizer)] = entry
    return entry[1]


def _compute_facts(tokenizer) -> TokenizerFacts:
    from tokenizers import Tokenizer

    backend = tokenizer.backend_tokenizer
    spec = json.loads(backend.to_str())
    text_backend = Tokenizer.from_str(backend.to_str())
    text_backend.no_truncation()
    text_backend.no_padding()
    text_backend.encode_special_tokens = True  # set once, never toggled: shared by every thread
    added = backend.get_added_tokens_decoder()
    specials = {tok.content: int(i) for i, tok in added.items() if tok.special}
    longest_added = max((len(tok.content) for tok in added.values()), default=0)
    return TokenizerFacts(
        max_bytes_per_token=_max_bytes_per_token(spec, backend, added), normalizer_safe=_widening(spec.get("normalizer")),
        longest_added=longest_added, backend=backend, text_backend=text_backend, specials=specials,
    )


def _widening(normalizer: dict | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_widening(n) for n in normalizer.get("normalizers", []))
    if kind == "Replace":
        pattern = normalizer.get("pattern", {})
        return "String" in pattern and len(normalizer.get("content", "").encode()) >= len(pattern["String"].encode())
    return kind in _WIDENING_NORMALIZERS


def _keeps_text(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _byte_level(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_byte_level(p) for p in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") == "ByteLevel"


def _max_bytes_per_token(spec: dict, backend, added: dict) -> int | None:
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not _keeps_text(spec.get("pre_tokenizer")):
        return None  # a word-level or unigram model may map a whole unknown word to one token
    if model.get("unk_token") and model.get("fuse_unk") and not model.get("byte_fallback"):
        return None  # a run of unknown characters fuses into one token
    if any(tok.lstrip or tok.rstrip for tok in added.values()):
        return None  # such a token also swallows the whitespace beside it
    byte_level = _byte_level(spec.get("pre_tokenizer"))
    # Byte-level vocabularies write each byte as one character; others are measured in UTF-8, which is never
    # less than what the piece stands for ("▁" is 3 bytes for a space, "<0x41>" 6 for one byte).
    longest = max((len(p) if byte_level else len(p.encode()) for p in backend.get_vocab(with_added_tokens=False)),
                  default=1)
    return max(longest, max((len(tok.content.encode()) for tok in added.values()), default=1), 1)


def min_tokens(facts: TokenizerFacts, text: str) -> int:
    """A lower bound of the tokens `text` makes (0 when the tokenizer allows none). Costs one UTF-8 encode of it,
    or, behind a normalizer that may shrink text, one normalization."""
    if facts.max_bytes_per_token is None:
        return 0
    if not facts.normalizer_safe:
        text = facts.backend.normalizer.normalize_str(text)
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / facts.max_bytes_per_token)


def _cut(text: str, start: int, target: int) -> tuple[int, bool]:
    """Where to end the slice that begins at `start`: a soft cut at or before `target`, else `target` itself."""
    lo = max(start + 1, target - SEAM_SEARCH_CHARS)
    i = text.rfind(" ", lo, target)
    while i >= lo:
        if not text[i - 1].isspace() and text[i + 1].isalpha():
            return i, True
        i = text.rfind(" ", lo, i)
    return target, False


def encode_within(facts: TokenizerFacts, text: str, budget: int, encode: Callable[[str], list[int]]) -> list[int]:
    """`encode(text)`, unless the text certainly makes more than `budget` tokens: then TooLong, after about
    budget + 1 tokens of work. `encode` must not add special tokens around the text (BOS and the like)."""
    lower = min_tokens(facts, text)
    if lower > budget:
        raise TooLong(lower)
    if len(text) > 2 * SLICE_CHARS:
        counted, slack, pos = 0, 0, 0
        while pos < len(text):
            end, soft = (len(text), True) if len(text) - pos <= 2 * SLICE_CHARS else _cut(text, pos, pos + SLICE_CHARS)
            counted += len(encode(text[pos:end]))
            if end < len(text):
                slack += SOFT_SEAM_SLACK if soft else HARD_SEAM_SLACK + facts.longest_added
            if counted - slack > budget:
                raise TooLong(max(lower, counted - slack))
            pos = end
    ids = encode(text)
    if len(ids) > budget:
        raise TooLong(len(ids), exact=True)
    return ids


def context_exceeded(context: int, prompt_tokens: int, max_tokens: int, *, param: str, at_least: bool) -> ApiError:
    has = f"at least {prompt_tokens}" if at_least else f"{prompt_tokens}"
    return invalid(
        f"This model's context is {context} tokens; the prompt has {has} and max_tokens asks for "
        f"{max_tokens} more. Shorten the prompt or lower max_tokens.",
        param=param, code="context_length_exceeded",
    )


def check_lists(params) -> None:
    """Caps on what the parser let through without a tokenizer: the number of messages, each stop string."""
    if len(params.messages) > MAX_MESSAGES:
        raise invalid(f"messages may hold at most {MAX_MESSAGES} messages; got {len(params.messages)}.",
                      param="messages")
    for s in params.stop:
        if len(s) > MAX_STOP_CHARS:
            raise invalid(f"Each stop string may be at most {MAX_STOP_CHARS} characters; one has {len(s)}.",
                          param="stop")


class LargeBodyTurn:
    """Held while a request whose body is LARGE_BODY_BYTES or more (by its Content-Length) is authenticated,
    read, parsed, bound and its prompt measured: one such request at a time per API key (taken before the key
    is even looked up) and per tenant (`take`, once it is known) in this process, each turn starting no sooner
    than a rest after the previous one (LARGE_BODY_REST times its length). Small bodies never wait; a request
    that waits holds no database connection. Released before the job is enqueued: a turn never spans a
    generation."""

    _by_key = [threading.Lock() for _ in range(_TURN_STRIPES)]
    _by_tenant = [threading.Lock() for _ in range(_TURN_STRIPES)]
    # When each stripe's next turn may start (time.monotonic()); written only by the stripe's lock holder.
    _key_rest_until = [0.0] * _TURN_STRIPES
    _tenant_rest_until = [0.0] * _TURN_STRIPES

    def __init__(self, request):
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        self.large = length >= LARGE_BODY_BYTES
        self._key = hash(request.META.get("HTTP_AUTHORIZATION", "")) % _TURN_STRIPES
        self._held: list[tuple[threading.Lock, list[float], int, float]] = []

    def __enter__(self) -> LargeBodyTurn:
        if self.large:
            self._wait(self._by_key, self._key_rest_until, self._key)
        return self

    def take(self, tenant) -> None:
        if self.large:
            self._wait(self._by_tenant, self._tenant_rest_until, tenant.pk % _TURN_STRIPES)

    def _wait(self, locks: list[threading.Lock], rest_until: list[float], stripe: int) -> None:
        if not connection.in_atomic_block:
            connection.close()  # back to the pool while this waits: other tenants' requests need it
        locks[stripe].acquire()
        try:
            rest = min(rest_until[stripe] - time.monotonic(), LARGE_BODY_MAX_REST_S)
            if rest > 0:
                time.sleep(rest)
        except BaseException:
            locks[stripe].release()
            raise
        self._held.append((locks[stripe], rest_until, stripe, time.monotonic()))

    def __exit__(self, *exc) -> None:
        now = time.monotonic()
        while self._held:
            lock, rest_until, stripe, started = self._held.pop()
            rest_until[stripe] = now + LARGE_BODY_REST * (now - started)
            lock.release()
