"""Datasets in the adapters storage, content-addressed as adapter blobs are: the key is the sha256 of the bytes,
and a key is never overwritten (adapters/storage.py explains why; the same backend, filesystem or S3)."""
from __future__ import annotations

from typing import BinaryIO

from django.core.files import File

from adapters.storage import BlobStorageError, adapter_storage, storage_error


def dataset_key(sha256: str) -> str:
    """"datasets/ab/abcdef….jsonl"."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise ValueError(f"not a lowercase sha256 hex digest: {sha256!r}")
    return f"datasets/{sha256[:2]}/{sha256}.jsonl"


def put_dataset(sha256: str, content: BinaryIO) -> str:
    """Store `content` (whose sha256 the caller computed) under its key; an existing blob is reused."""
    key = dataset_key(sha256)
    storage = adapter_storage()
    try:
        if storage.exists(key):
            return key
        content.seek(0)
        saved = storage.save(key, File(content, name=key))
        if saved != key:  # a concurrent upload of the same bytes won the race: keep its blob
            storage.delete(saved)
        return key
    except Exception as exc:
        raise storage_error(exc, key) from exc


def open_dataset(key: str) -> BinaryIO:
    try:
        return adapter_storage().open(key, "rb")
    except Exception as exc:
        raise storage_error(exc, key) from exc


def iter_dataset(key: str, chunk_bytes: int = 1024 * 1024):
    with open_dataset(key) as fh:
        yield from iter(lambda: fh.read(chunk_bytes), b"")


def delete_dataset(key: str) -> None:
    try:
        adapter_storage().delete(key)
    except Exception as exc:
        raise storage_error(exc, key) from exc


__all__ = ["BlobStorageError", "dataset_key", "put_dataset", "open_dataset", "iter_dataset", "delete_dataset"]
