"""The upload service: stream, cap, hash, validate, store content-addressed, record — or leave no trace.

Order matters:
1. Refuse a deleted adapter before reading anything.
2. Stream the weights into an anonymous temporary file in fixed chunks, hashing as we go and stopping
   the moment the size cap is passed (web memory stays bounded whatever the body size). A pickle or a
   torch zip archive is refused by name and by its first bytes; it is never loaded.
3. Validate (adapters.validation): config, safetensors header, tensors against the base, NaN/Inf.
4. Store the blob under its sha256 — outside any database transaction, so no row lock is held during
   slow S3 I/O.
5. Write the row in a short transaction under a row lock on the Adapter (numbers 1, 2, 3… with no gaps
   or duplicates even for concurrent uploads), and activate it when asked or when nothing is live yet.
If step 5 fails, the blob written in step 4 is deleted unless another version references it; if step
4 fails half-way, no row is ever written. Blobs are shared by content, so a concurrent upload of the
same bytes may reuse the blob that a failing upload is about to delete: the delete ("no row uses it")
and step 5 ("it exists; reference it") take one per-blob lock, and step 5 stores the bytes again if
they are gone.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import BinaryIO

from django.conf import settings
from django.core.files.uploadhandler import FileUploadHandler, StopUpload
from django.db import connection, transaction
from django.db.models import Max
from django.http import QueryDict
from django.utils.datastructures import MultiValueDict

from .models import Adapter, AdapterVersion
from .services import AdapterStateError, activate_version
from .storage import BlobStorageError, blob_exists, blob_sha256, delete_blob, put_blob, storage_error, storage_key_for
from .validation import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    AdapterSpec,
    AdapterValidationError,
    parse_config,
    validate_adapter,
)

log = logging.getLogger(__name__)

STREAM_CHUNK_BYTES = 1024 * 1024
# Extensions of formats that are (or wrap) Python pickles: loading one can run arbitrary code.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


class AdapterDeleted(AdapterValidationError, AdapterStateError):
    """Uploads to a deleted adapter are refused (the API answers 410)."""


def _human_bytes(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"  # unreachable


def _iter_chunks(upload, chunk_size: int) -> Iterator[bytes]:
    """Chunks of a Django File/UploadedFile or any binary file-like object."""
    if hasattr(upload, "chunks"):
        yield from upload.chunks(chunk_size)
        return
    while True:
        chunk = upload.read(chunk_size)
        if not chunk:
            return
        yield chunk


def _declared_size(upload) -> int | None:
    size = getattr(upload, "size", None)
    return size if isinstance(size, int) else None


def _pickle_kind(head: bytes) -> str | None:
    """What a non-safetensors file starting with `head` is, if it is a pickle-based format."""
    if len(head) >= 9 and head[8:9] == b"{":
        return None  # a safetensors length prefix followed by its JSON header
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "a Python pickle (a PyTorch .bin checkpoint)"
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (PyTorch's torch.save format, which contains a pickle)"
    return None


def refuse_pickle_name(upload, field: str) -> None:
    name = os.path.basename(str(getattr(upload, "name", "") or ""))
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise AdapterValidationError(
            field, f"{name} is a pickle-based file; pickles can run code and are never loaded. "
                   f"Upload {WEIGHTS_FILE} (save with safe_serialization=True, PEFT's default)."
        )


def read_config(upload) -> dict:
    """The adapter_config.json upload, read with a small cap, parsed."""
    declared = _declared_size(upload)
    if declared is not None and declared > MAX_CONFIG_BYTES:
        raise AdapterValidationError(CONFIG_FILE, f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES // 1024} KB.")
    data = bytearray()
    for chunk in _iter_chunks(upload, 64 * 1024):
        data += chunk
        if len(data) > MAX_CONFIG_BYTES:
            raise AdapterValidationError(CONFIG_FILE, f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES // 1024} KB.")
    return parse_config(bytes(data))


def spool_weights(upload, dest: BinaryIO, *, max_bytes: int) -> tuple[str, int]:
    """Copy the weights upload into `dest` chunk by chunk; returns (sha256 hex, size in bytes).

    Stops reading as soon as the total passes `max_bytes`, and refuses a pickle from its first bytes.
    """
    refuse_pickle_name(upload, WEIGHTS_FILE)
    limit = _human_bytes(max_bytes)
    declared = _declared_size(upload)
    if declared is not None and declared > max_bytes:
        raise AdapterValidationError(WEIGHTS_FILE, f"{WEIGHTS_FILE} is {_human_bytes(declared)}; "
                                                   f"the upload limit is {limit}.")
    digest = hashlib.sha256()
    size = 0
    head = b""
    for chunk in _iter_chunks(upload, STREAM_CHUNK_BYTES):
        if len(head) < 16:
            head += chunk[: 16 - len(head)]
            if len(head) >= 16 and (kind := _pickle_kind(head)):
                raise AdapterValidationError(
                    WEIGHTS_FILE, f"the weights file is {kind}; pickles can run code and are never loaded. "
                                  f"Upload {WEIGHTS_FILE}."
                )
        size += len(chunk)
        if size > max_bytes:
            raise AdapterValidationError(WEIGHTS_FILE, f"{WEIGHTS_FILE} is larger than the upload limit "
                                                       f"of {limit}; the upload was stopped.")
        digest.update(chunk)
        dest.write(chunk)
    if (kind := _pickle_kind(head)) is not None:  # a file shorter than 16 bytes
        raise AdapterValidationError(WEIGHTS_FILE, f"the weights file is {kind}; pickles are never loaded.")
    dest.flush()
    return digest.hexdigest(), size


def _refuse_if_deleted(adapter: Adapter) -> None:
    if adapter.is_deleted:
        raise AdapterDeleted("adapter", f"adapter {adapter.name!r} is deleted; it accepts no new versions.")


def _store(sha256: str, content: BinaryIO) -> tuple[str, bool]:
    """put_blob, turning any storage failure into BlobStorageError and cleaning a half-written key."""
    key = storage_key_for(sha256)
    try:
        return put_blob(sha256, content)
    except BlobStorageError as corrupt:
        return _replace_corrupt(key, sha256, content, corrupt)
    except Exception as exc:
        try:
            if blob_exists(key) and blob_sha256(key) != sha256:
                delete_blob(key)  # our partial write; a complete blob of the same bytes is left alone
        except Exception:  # the storage is failing; the orphan (if any) is unreferenced garbage
            log.exception("could not clean up after a failed write of %s", key)
        raise _write_failed(exc, key) from exc


def _write_failed(exc: Exception, key: str) -> BlobStorageError:
    """The failure as its code and a sentence of ours (adapters.storage.storage_error); the library's text is logged."""
    log.warning("storing %s failed: %r", key, exc)
    cause = storage_error(exc, key)
    return BlobStorageError(f"storing the adapter weights failed: {cause}", cause.code)


def _replace_corrupt(key: str, sha256: str, content: BinaryIO, corrupt: BlobStorageError) -> tuple[str, bool]:
    """A blob under our key with other content: left by a crash mid-write. If no version uses it, it is garbage
    and is replaced; if one does, storage is corrupt and needs an operator (`corrupt` is raised).

    Under the blob's lock, as the recording of a version is: two uploads that both found the leftover replace
    it one after the other, and the second finds the first's blob and reuses it, instead of deleting a blob
    that the first may have recorded a version of by then."""
    with transaction.atomic():
        _lock_blob(key)
        if AdapterVersion.objects.filter(storage_key=key).exists():
            raise corrupt
        try:
            if blob_exists(key):
                if blob_sha256(key) == sha256:
                    return key, False  # a concurrent upload of the same bytes replaced it first
                log.warning("replacing corrupt unreferenced blob %s", key)
                delete_blob(key)
            return put_blob(sha256, content)
        except BlobStorageError:
            raise
        except Exception as exc:
            raise _write_failed(exc, key) from exc


def _lock_blob(key: str) -> None:
    """Holds, until the transaction ends, the lock that serializes deleting a blob against referencing it.

    A PostgreSQL transaction-level advisory lock keyed by the blob's key. The embedded SQLite default
    takes none: it serves one node's uploads, and its writers already run one at a time.
    """
    if connection.vendor != "postgresql":
        return
    lock_id = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [lock_id])


def _record_version(adapter: Adapter, spec: AdapterSpec, *, sha256: str, key: str, size: int,
                    created_by, activate: bool | None, content: BinaryIO) -> AdapterVersion:
    with transaction.atomic():
        locked = Adapter.objects.select_for_update().get(pk=adapter.pk)
        _refuse_if_deleted(locked)
        _lock_blob(key)
        if not blob_exists(key):  # a failed upload of the same bytes deleted it after we found it
            log.warning("blob %s vanished before its version was recorded; storing it again", key)
            _store(sha256, content)
        last = locked.versions.aggregate(last=Max("number"))["last"] or 0
        version = AdapterVersion.objects.create(
            adapter=locked, number=last + 1, sha256=sha256, storage_key=key, size_bytes=size,
            rank=spec.rank, alpha=spec.alpha, use_rslora=spec.use_rslora,
            target_modules=spec.target_modules, dtype=spec.dtype, parameter_count=spec.parameter_count,
            peft_config=spec.peft_config, created_by=created_by,
        )
        if activate or (activate is None and locked.active_version_id is None):
            reason = "uploaded with activate" if activate else "first version"
            activate_version(locked, version, actor=created_by, reason=reason)
            adapter.active_version = version
    return version


def create_adapter_version(adapter: Adapter, *, config_file, weights_file, created_by=None,
                           activate: bool | None = None) -> AdapterVersion:
    """Validate and store one PEFT upload as the adapter's next version.

    `config_file`/`weights_file`: Django UploadedFiles or binary file-like objects. `activate`: True
    makes it live, False never, None makes it live only if the adapter has no live version yet.
    Raises AdapterValidationError (nothing stored) or BlobStorageError (nothing recorded).
    """
    adapter.refresh_from_db(fields=["deleted_at", "active_version"])
    _refuse_if_deleted(adapter)
    base = adapter.base
    config = read_config(config_file)
    with tempfile.TemporaryFile(dir=getattr(settings, "FILE_UPLOAD_TEMP_DIR", None)) as spool:
        sha256, size = spool_weights(weights_file, spool, max_bytes=settings.LORAFLEET_MAX_UPLOAD_BYTES)
        spec = validate_adapter(config, spool, size, base.shape_manifest, base.max_lora_rank)
        key, _ = _store(sha256, spool)
        try:
            return _record_version(adapter, spec, sha256=sha256, key=key, size=size, created_by=created_by,
                                   activate=activate, content=spool)
        except BaseException:
            # Whoever wrote the blob, it is garbage unless a version uses it; a concurrent upload of the
            # same bytes that has not recorded its version yet stores them again (see _record_version).
            _delete_if_unreferenced(key)
            raise


def _delete_if_unreferenced(key: str) -> None:
    """Remove a blob this upload stored or reused, unless a version uses it."""
    try:
        with transaction.atomic():
            _lock_blob(key)
            if not AdapterVersion.objects.filter(storage_key=key).exists():
                delete_blob(key)
    except Exception:  # database or storage down: an unreferenced orphan is harmless, a lost row is not
        log.exception("could not delete blob %s after a failed upload", key)


# --- the HTTP side: stop reading a request body at the cap --------------------------------------


class SizeCappedUploadHandler(FileUploadHandler):
    """First in request.upload_handlers: stops reading the body as soon as one file passes the cap.

    Django otherwise spools a whole multipart body to disk before the view runs, so a 10 GB upload
    would be read in full only to be refused. Raising StopUpload(connection_reset=True) makes the
    parser stop reading at once; `upload_cut_error(request)` then says why the file is missing.
    """

    def __init__(self, request=None, max_bytes: int | None = None):
        super().__init__(request)
        self.max_bytes = max_bytes if max_bytes is not None else settings.LORAFLEET_MAX_UPLOAD_BYTES
        self.received = 0

    def handle_raw_input(self, input_data, META, content_length, boundary, encoding=None):
        # A declared body far over the cap is refused before a byte of it is read.
        # Returning (POST, FILES) tells Django the body is handled: nothing is parsed or read.
        if content_length and content_length > self.max_bytes + MAX_CONFIG_BYTES + 64 * 1024:
            if self.request is not None:
                self.request.lorafleet_upload_cut = (WEIGHTS_FILE, self.max_bytes)
            return QueryDict(encoding=encoding), MultiValueDict()
        return None

    def new_file(self, *args, **kwargs):
        super().new_file(*args, **kwargs)
        self.received = 0

    def receive_data_chunk(self, raw_data, start):
        self.received += len(raw_data)
        if self.received > self.max_bytes:
            self._cut(self.file_name or self.field_name)
        return raw_data  # hand the chunk on to Django's own (temporary-file) handler

    def file_complete(self, file_size):
        return None

    def _cut(self, what: str):
        if self.request is not None:
            self.request.lorafleet_upload_cut = (what, self.max_bytes)
        raise StopUpload(connection_reset=True)


def cap_upload_size(request, max_bytes: int | None = None) -> None:
    """Call in a view before touching request.POST/FILES."""
    request.upload_handlers.insert(0, SizeCappedUploadHandler(request, max_bytes))


def upload_cut_error(request) -> AdapterValidationError | None:
    """The refusal to show when SizeCappedUploadHandler stopped this request's body, else None."""
    cut = getattr(request, "lorafleet_upload_cut", None)
    if cut is None:
        return None
    what, max_bytes = cut
    return AdapterValidationError(WEIGHTS_FILE, f"{what} is larger than the upload limit of "
                                                f"{_human_bytes(max_bytes)}; the upload was stopped.")
