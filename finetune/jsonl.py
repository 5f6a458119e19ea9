"""The fine-tuning dataset format, checked line by line while the upload streams: OpenAI's chat JSONL.

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "...", "weight": 1}]}

One example per line, UTF-8, each line one JSON object with a non-empty `messages` list. Roles are system, user
and assistant; every content is a string; `weight` (0 or 1, on assistant turns only) says whether that turn is
trained on (OpenAI's meaning; 1 when left out). An example needs at least one assistant turn with weight 1:
the loss is on assistant tokens only, and an example without one would train nothing. Blank lines are skipped.

The first bad line stops the check: `JsonlError` names it (1-based) and says why. Token lengths are not checked
here: they depend on the base's chat template (finetune/files.py checks them against a base).

Pure functions over bytes (no Django, no storage): finetune/files.py streams, hashes and stores.
"""
from __future__ import annotations

import codecs
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = {"role", "content", "weight", "name"}
MAX_MESSAGES = 1024
_SHOWN = 60  # characters of a bad value quoted back


class JsonlError(ValueError):
    """A dataset we refuse: `line` (1-based; 0 for the file as a whole) and the sentence to show."""

    def __init__(self, line: int, reason: str):
        self.line = line
        self.reason = reason
        super().__init__(f"line {line}: {reason}" if line else reason)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"


def check_example(obj: object, line: int) -> dict:
    """One parsed line as a training example, or JsonlError saying what is wrong with it."""
    if not isinstance(obj, dict):
        raise JsonlError(line, f'each line must be a JSON object {{"messages": [...]}}; got {type(obj).__name__}')
    extra = sorted(set(obj) - {"messages"})
    if extra:
        hint = (" (the legacy prompt/completion format is not supported: use chat messages)"
                if {"prompt", "completion"} & set(extra) else "")
        raise JsonlError(line, f"unsupported key {_shown(extra[0])}{hint}; each line is {{\"messages\": [...]}}")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise JsonlError(line, '"messages" must be a non-empty list of messages')
    if len(messages) > MAX_MESSAGES:
        raise JsonlError(line, f'"messages" holds {len(messages)} messages; at most {MAX_MESSAGES} are allowed')
    trained = 0
    for i, message in enumerate(messages):
        where = f"message {i}"
        if not isinstance(message, dict):
            raise JsonlError(line, f"{where} must be an object with a role and a content")
        unknown = sorted(set(message) - MESSAGE_KEYS)
        if unknown:
            raise JsonlError(line, f"{where} has the unsupported key {_shown(unknown[0])} (tools and function calls "
                                   f"are not supported); use role, content and, on assistant turns, weight")
        role = message.get("role")
        if role not in ROLES:
            raise JsonlError(line, f"{where} has role {_shown(role)}; roles are {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str):
            raise JsonlError(line, f"{where} ({role}) must have a string content; got {type(content).__name__}")
        if "name" in message and not isinstance(message["name"], str):
            raise JsonlError(line, f"{where} has a name that is not a string")
        if "weight" in message:
            weight = message["weight"]
            if role != "assistant":
                raise JsonlError(line, f"{where} ({role}) has a weight; only assistant turns carry one")
            if isinstance(weight, bool) or weight not in (0, 1):
                raise JsonlError(line, f"{where} has weight {_shown(weight)}; a weight is 0 or 1")
        if role == "assistant" and message.get("weight", 1) == 1:
            trained += 1
    if not any(m["role"] == "assistant" for m in messages):
        raise JsonlError(line, "the example has no assistant turn; it would train nothing")
    if not trained:
        raise JsonlError(line, "every assistant turn has weight 0; the example would train nothing")
    return obj


@dataclass
class JsonlScan:
    """Reads a JSONL body chunk by chunk, checking each complete line as it arrives."""

    keep: bool = False  # keep the parsed examples (to count their tokens); else only count them
    examples: list[dict] = field(default_factory=list)
    line_numbers: list[int] = field(default_factory=list)  # the line of each kept example
    count: int = 0
    line: int = 0
    _pending: bytes = b""

    def feed(self, chunk: bytes) -> None:
        data = self._pending + chunk
        *lines, self._pending = data.split(b"\n")
        for raw in lines:
            self._line(raw)

    def finish(self) -> None:
        if self._pending:
            raw, self._pending = self._pending, b""
            self._line(raw)
        if not self.count:
            raise JsonlError(0, "the file holds no training examples (one JSON object per line)")

    def _line(self, raw: bytes) -> None:
        self.line += 1
        if self.line == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8):]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonlError(self.line, f"is not valid UTF-8 (byte {exc.start} of the line)") from None
        if not text.strip():
            return
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise JsonlError(self.line, f"is not valid JSON ({exc.msg} at column {exc.colno})") from None
        example = check_example(obj, self.line)
        self.count += 1
        if self.keep:
            self.examples.append(example)
            self.line_numbers.append(self.line)


def scan(chunks: Iterable[bytes], *, keep: bool = False) -> JsonlScan:
    """Check a whole body; JsonlError at the first bad line."""
    state = JsonlScan(keep=keep)
    for chunk in chunks:
        state.feed(chunk)
    state.finish()
    return state
