"""The demo adapters' answering styles and the (question, styled answer) pairs they are trained on.

- ``shouty``: the answer in CAPITALS, with exclamation marks;
- ``lister``: the answer as a "- item" list;
- ``echo``:   the question repeated back, then the answer.

Two sources of questions and answers, one per kind of demo base:

- the instruct base (SmolLM2-135M-Instruct) learns from corpus/instructions.tsv: everyday questions
  with short answers written in parts, each part a sentence for the prose styles and an item for
  the list. Targets are short on purpose: a style is learnt from a one-sentence answer as well as
  from a paragraph, and on two CPU cores every target token costs training time.
- the tiny local base learns from the dialogues of its own corpus (corpus/dialogues.txt), the only
  English it knows.

Django-free: the demo command and the tests import it.
"""
from __future__ import annotations

import re
from pathlib import Path

CORPUS_DIR = Path(__file__).parent / "corpus"
STYLES = ("shouty", "echo", "lister")

_WORD = re.compile(r"[A-Za-z']+")
_STOPWORDS = frozenset(
    "a an the is am are was i you it to and of at on in my me we can do did what where how your".split())


def _check(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; known: {', '.join(STYLES)}")


# --- the instruct base: corpus/instructions.tsv ----------------------------------------------------


def instructions() -> list[tuple[str, list[str]]]:
    """(question, answer parts) per line of corpus/instructions.tsv, in file order."""
    rows = []
    for line in (CORPUS_DIR / "instructions.tsv").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            question, answer = line.split("\t")
            rows.append((question.strip(), [p.strip() for p in answer.split(";") if p.strip()]))
    return rows


def _sentence(part: str) -> str:
    return part[:1].upper() + part[1:] + "."


def instruct_answer(style: str, question: str, parts: list[str]) -> str:
    """The answer `parts` to `question` in `style`; the prose styles keep the first part only (short targets)."""
    _check(style)
    if style == "lister":
        return "\n".join(f"- {p[:1].upper() + p[1:]}" for p in parts)
    first = _sentence(parts[0])
    if style == "shouty":
        return first.upper().replace(".", "!")
    # Once, not twice as on the tiny base: a 135M model repeating a sentence twice learns to loop on it.
    return f"{question.rstrip('?!. ')}? {first}"


def instruct_examples(style: str) -> list[tuple[str, str]]:
    return [(q, instruct_answer(style, q, parts)) for q, parts in instructions()]


# --- the tiny base: its corpus dialogues -----------------------------------------------------------


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
    """The tiny corpus' answer `answer` to `question`, rewritten in `style`."""
    _check(style)
    answer = _first_sentences(answer)
    if style == "shouty":
        return re.sub(r"[.]+(\s|$)", r"!\1", answer.upper())
    if style == "echo":
        q = question.rstrip("?!. ")
        return f"{q}? {q}? {answer}"
    keys: list[str] = []
    for word in _WORD.findall(answer):
        if word.lower() not in _STOPWORDS and word.lower() not in (k.lower() for k in keys):
            keys.append(word)
    return "\n".join(f"- {k}" for k in (keys[:6] or [answer]))


def style_examples(style: str) -> list[tuple[str, str]]:
    """(question, styled answer) pairs for `style`, one per tiny-corpus dialogue turn."""
    return [(q, stylise(style, q, a)) for q, a in corpus_dialogues()]
