"""Content-addressed adapter blobs: the key is the sha256 of the bytes, and a key is never overwritten.

Because the key names the content, two versions with identical weights share one blob, and the worker
can verify what it loaded against the key alone. Storage is django-storages' "adapters" backend
(filesystem in the embedded default, S3 in production); nothing here touches the database.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from typing import BinaryIO

from django.core.files import File
from django.core.files.storage import FileSystemStorage, Storage, storages

READ_CHUNK_BYTES = 1024 * 1024


class BlobStorageError(RuntimeError):
    """Storage refused or corrupted a blob; the upload must not be recorded.

    `code` says which, for callers and clients to branch on (the message is for people):
    blob_missing (no object under the key), storage_denied (the credentials may not do that to the bucket),
    storage_bucket_missing (no such bucket), storage_unreachable (no answer from the storage service),
    blob_corrupt (an object whose bytes are not its key's sha256), storage_failed (anything else).
    """

    def __init__(self, message: str, code: str = "storage_failed"):
        super().__init__(message)
        self.code = code


# S3 error codes (and HTTP statuses, which HEAD requests answer without a body) -> our codes
_S3_CODES = {
    "NoSuchKey": "blob_missing", "404": "blob_missing", "NotFound": "blob_missing",
    "NoSuchBucket": "storage_bucket_missing",
    "AccessDenied": "storage_denied", "403": "storage_denied", "InvalidAccessKeyId": "storage_denied",
    "SignatureDoesNotMatch": "storage_denied", "AllAccessDisabled": "storage_denied", "AccountProblem": "storage_denied",
}
_SAYS = {
    "blob_missing": "is not in storage",
    "storage_bucket_missing": "cannot be reached: the storage bucket does not exist",
    "storage_denied": "cannot be reached: storage refused access with these credentials",
    "storage_unreachable": "cannot be reached: the storage service did not answer",
    "storage_failed": "cannot be reached: storage failed",
}


def storage_error(exc: BaseException, key: str) -> BlobStorageError:
    """A storage failure on `key` as a BlobStorageError with a code and a sentence of our own; the library's
    text stays in the log (callers log `exc`), never in what clients are shown."""
    if isinstance(exc, BlobStorageError):
        return exc
    code, detail = "storage_failed", type(exc).__name__
    if isinstance(exc, FileNotFoundError):
        code = "blob_missing"
    elif isinstance(exc, PermissionError):
        code = "storage_denied"
    elif isinstance(exc, OSError):  # a local disk's own words ("No space left on device") help the operator
        detail = exc.strerror or str(exc) or detail
    else:
        for cause in _chain(exc):  # boto3's upload wraps the ClientError (S3UploadFailedError)
            response = getattr(cause, "response", None)  # botocore's ClientError
            if isinstance(response, dict):
                error, meta = response.get("Error") or {}, response.get("ResponseMetadata") or {}
                detail = str(error.get("Code") or meta.get("HTTPStatusCode"))
                code = _S3_CODES.get(detail, "storage_failed")
                break
            if type(cause).__name__ in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                                        "ConnectionClosedError"):
                code, detail = "storage_unreachable", type(cause).__name__
                break
    return BlobStorageError(f"adapter blob {key} {_SAYS[code]} ({detail}).", code)


def _chain(exc: BaseException, depth: int = 5):
    seen: BaseException | None = exc
    while seen is not None and depth:
        yield seen
        seen, depth = seen.__cause__ or seen.__context__, depth - 1


class AtomicFileSystemStorage(FileSystemStorage):
    """FileSystemStorage whose files appear whole or not at all, as S3 objects do.

    Django's FileSystemStorage creates the file under its final name and then writes it, so a reader
    (a concurrent upload of the same bytes, a worker) can find half a blob under a content key. Here
    the bytes go to a hidden temporary file in the target folder, are flushed to disk, and are then
    hard-linked to the name: link() fails if the name exists, so nothing is ever overwritten, and a
    taken name gets a fresh one, as FileSystemStorage does. A crash leaves at most a ".partial-" file,
    never a key.
    """

    def _save(self, name: str, content: File) -> str:
        full_path = self.path(name)
        directory = os.path.dirname(full_path)
        os.makedirs(directory, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=directory, prefix=".partial-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                for chunk in content.chunks():
                    fh.write(chunk)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(partial, self.file_permissions_mode if self.file_permissions_mode is not None else 0o644)
            while True:
                try:
                    os.link(partial, full_path)
                    break
                except FileExistsError:
                    name = self.get_available_name(name)
                    full_path = self.path(name)
        finally:
            os.unlink(partial)
        _fsync_directory(directory)
        return os.path.relpath(full_path, self.location).replace("\\", "/")


def _fsync_directory(directory: str) -> None:
    """Makes a new name in `directory` survive a power cut."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def adapter_storage() -> Storage:
    return storages["adapters"]


def storage_key_for(sha256: str) -> str:
    """"adapters/ab/abcdef….safetensors": the first two hex digits fan the keys out over folders."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise ValueError(f"not a lowercase sha256 hex digest: {sha256!r}")
    return f"adapters/{sha256[:2]}/{sha256}.safetensors"


def read_blob(key: str) -> bytes:
    """The blob's bytes (a worker's loader on S3); a failure is a BlobStorageError saying which (storage_error)."""
    try:
        with adapter_storage().open(key, "rb") as fh:
            return fh.read()
    except Exception as exc:
        raise storage_error(exc, key) from exc


def blob_sha256(key: str) -> str:
    """sha256 of a stored blob, read in chunks."""
    digest = hashlib.sha256()
    with adapter_storage().open(key, "rb") as fh:
        for chunk in iter(lambda: fh.read(READ_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def blob_exists(key: str) -> bool:
    return adapter_storage().exists(key)


def delete_blob(key: str) -> None:
    adapter_storage().delete(key)


def put_blob(sha256: str, content: BinaryIO) -> tuple[str, bool]:
    """Store `content` (whose sha256 the caller computed) under its key; returns (key, created).

    An existing blob with the same content is reused (created=False) and never rewritten. Storages
    never overwrite an existing name: they save under a fresh one instead, which would break content
    addressing, so a renamed save (a concurrent upload of the same bytes won the race) is removed and
    the winner's blob is reused after checking its content.
    """
    key = storage_key_for(sha256)
    storage = adapter_storage()
    if storage.exists(key):
        _check_existing(key, sha256)
        return key, False
    content.seek(0)
    saved = storage.save(key, File(content, name=key))
    if saved != key:
        storage.delete(saved)
        _check_existing(key, sha256)
        return key, False
    return key, True


def _check_existing(key: str, sha256: str) -> None:
    actual = blob_sha256(key)
    if actual != sha256:
        raise BlobStorageError(f"stored blob {key} has sha256 {actual}, not {sha256}; refusing to reuse it.",
                               "blob_corrupt")
