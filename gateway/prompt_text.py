"""Message content is text (issue 47): a control token's string inside `content` is encoded as ordinary text.

The chat template writes the control tokens that frame the roles (`<|im_start|>user\\n … <|im_end|>`); a
message that carries the same strings must not be able to end its turn and open a forged `system` one. So
the template is rendered with a sentinel in place of each message's content, which tells apart what the
template wrote from what the caller wrote:

- in the template's text, special-token strings are the tokenizer's special tokens, as transformers'
  `apply_chat_template(tokenize=True)` makes them;
- in content, they are text: the tokenizer's copy that encodes special-token strings as text (set once in
  gateway/input_bounds.py's facts, never toggled on a shared tokenizer) reads them.

The ids are built the way a tokenizer builds them — split at the special tokens it honours, each run of text
between them encoded whole — so for content without control-token strings they are exactly transformers'
ids. Templates that trim content (Llama 3's `message['content'] | trim`) are recognised from whitespace
around the sentinel; a template that drops a message leaves no sentinel for it.

`/v1/completions`: a string prompt is the raw interface — a tenant writing its own template needs the
control tokens, as in OpenAI's and vLLM's completions — unless the request sets `"prompt_as_text": true`:
then the prompt's control-token strings are text too (`text_ids`), and the worker reads those ids.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from .input_bounds import TokenizerFacts

_PAD = " \n "  # around each sentinel: a template that strips content strips this too


@dataclass
class Rendered:
    """A rendered chat: runs of template text, special tokens the template wrote, and message contents."""

    parts: list[tuple[str, str]]  # ("template", text) | ("content", text)

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.parts)


def render(tokenizer, messages: list[dict[str, str]]) -> Rendered:
    """The chat as the template renders it, with each message's content marked as such."""
    nonce = secrets.token_hex(8)
    marks = [f"\ue000{nonce}{i}\ue001" for i in range(len(messages))]
    skeleton = tokenizer.apply_chat_template(
        [{**m, "content": _PAD + mark + _PAD} for m, mark in zip(messages, marks, strict=True)],
        tokenize=False, add_generation_prompt=True,
    )
    by_mark = {mark: m["content"] for mark, m in zip(marks, messages, strict=True)}
    pattern = re.compile("(?:" + re.escape(_PAD) + ")?(" + "|".join(map(re.escape, marks)) + ")(?:"
                         + re.escape(_PAD) + ")?")
    parts: list[tuple[str, str]] = []
    pos = 0
    for m in pattern.finditer(skeleton):
        if m.start() > pos:
            parts.append(("template", skeleton[pos:m.start()]))
        content = by_mark[m.group(1)]
        left, right = m.group(0).startswith(_PAD), m.group(0).endswith(_PAD)
        # The template's own treatment of the content, read from what it did to the padding around the mark.
        if not left and not right:
            content = content.strip()
        elif not left:
            content = content.lstrip()
        elif not right:
            content = content.rstrip()
        parts.append(("content", content))
        pos = m.end()
    if pos < len(skeleton):
        parts.append(("template", skeleton[pos:]))
    return Rendered(parts)


def segments(facts: TokenizerFacts, rendered: Rendered) -> list[int | str]:
    """The chat as a tokenizer sees it: special-token ids (only where the template wrote them) and runs of text
    between them (template text and content joined, as one encode would read them)."""
    out: list[int | str] = []
    run: list[str] = []
    special = _special_pattern(facts)
    for kind, text in rendered.parts:
        if kind == "content" or special is None:
            run.append(text)
            continue
        pos = 0
        for m in special.finditer(text):
            run.append(text[pos:m.start()])
            if any(run):
                out.append("".join(run))
            run = []
            out.append(facts.specials[m.group(0)])
            pos = m.end()
        run.append(text[pos:])
    if any(run):
        out.append("".join(run))
    return out


_patterns: dict[int, tuple[TokenizerFacts, re.Pattern | None]] = {}


def _special_pattern(facts: TokenizerFacts) -> re.Pattern | None:
    entry = _patterns.get(id(facts))
    if entry is None or entry[0] is not facts:
        # longest first, so that a special token that begins another is not matched in its place
        names = sorted(facts.specials, key=len, reverse=True)
        entry = (facts, re.compile("|".join(map(re.escape, names))) if names else None)
        _patterns[id(facts)] = entry
    return entry[1]


def text_ids(facts: TokenizerFacts, text: str) -> list[int]:
    """`text` encoded as text: special-token strings in it are ordinary characters. No BOS or other added tokens."""
    return list(facts.text_backend.encode(text, add_special_tokens=False).ids)
