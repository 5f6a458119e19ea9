"""Builders for the fine-tuning tests: examples, JSONL bodies, uploads through the test client."""
from __future__ import annotations

import json
from pathlib import Path


def example(question: str, answer: str, **assistant) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer, **assistant}]}


def jsonl(examples: list) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in examples)


GOOD_EXAMPLES = [example(f"What is {i} plus {i}?", f"It is {2 * i}.") for i in range(12)]


def auth(secret: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {secret}"}


def upload(client, secret: str, data: bytes, *, name: str = "train.jsonl", purpose: str = "fine-tune", **fields):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return client.post("/v1/files", {"file": SimpleUploadedFile(name, data), "purpose": purpose, **fields},
                       **auth(secret))


def stored_files(storage: Path) -> list[Path]:
    return [p for p in storage.rglob("*") if p.is_file()] if storage.exists() else []
