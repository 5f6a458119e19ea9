"""The Files service: stream, cap, hash and check a JSONL dataset, store it by sha256, record it — or leave no trace.

Order (as adapters/uploads.py does for weights):
1. Stream the upload into an anonymous temporary file in chunks, hashing and checking each complete line as it
   arrives (finetune/jsonl.py); the first bad line, or passing LORAFLEET_FINETUNE_MAX_FILE_BYTES, stops reading.
2. When the caller names a base (`model`, a lorafleet extension), count each example's tokens with that base's
   chat template and refuse one longer than its context. Without a base the file is checked for structure only,
   and the token check runs when a job names its base (finetune/jobs.py), as OpenAI does at job time: a file
   does not belong to one base, and may be trained on several.
3. Store the bytes under their sha256 (finetune/storage.py), then write the row. A refused file leaves nothing.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from django.conf import settings
from django.core.files.uploadhandler import FileUploadHandler, StopUpload
from django.db import transaction
from django.utils import timezone

from adapters.models import BaseModel
from adapters.storage import BlobStorageError
from gateway.errors import ApiError, invalid

from .jsonl import JsonlError, JsonlScan, scan
from .models import ACTIVE_STATUSES, FineTuningJob, TrainingFile
from .storage import delete_dataset, iter_dataset, put_dataset

log = logging.getLogger(__name__)

PURPOSE = "fine-tune"
CHUNK_BYTES = 256 * 1024


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{int(n)} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"  # unreachable


def file_not_found(file_id: str, param: str = "file_id") -> ApiError:
    # The same answer for "missing", "deleted" and "another tenant's": existence is not leaked.
    return ApiError(404, "file_not_found", f"No file {str(file_id)[:80]!r} exists or you do not have access to it.",
                    param=param)


def invalid_file(err: JsonlError, *, file_label: str = "The file") -> ApiError:
    where = f"{file_label}, line {err.line}" if err.line else file_label
    return invalid(f"{where}: {err.reason}. Nothing was stored.", param="file", code="invalid_file")


def too_large(max_bytes: int) -> ApiError:
    return ApiError(413, "file_too_large", f"The file is larger than the limit of {human_bytes(max_bytes)} "
                                           f"(LORAFLEET_FINETUNE_MAX_FILE_BYTES); the upload was stopped.", param="file")


def _chunks(upload) -> Iterable[bytes]:
    if hasattr(upload, "chunks"):
        yield from upload.chunks(CHUNK_BYTES)
        return
    yield from iter(lambda: upload.read(CHUNK_BYTES), b"")


def count_tokens(base: BaseModel, examples: list[dict]) -> list[int]:
    """Tokens of each example with the base's chat template (the trainer's own count, finetune/training.py)."""
    from .training import count_training_tokens

    return count_training_tokens(Path(base.checkpoint_path), examples)


def base_context(base: BaseModel) -> int:
    from gateway.prompts import base_context as context_of

    return context_of(base)


def check_token_lengths(base: BaseModel, state: JsonlScan, *, file_label: str, param: str) -> int:
    """The examples' tokens in total; 400 `example_too_long` naming the first example longer than the base's context."""
    try:
        counts = count_tokens(base, state.examples)
    except ValueError as exc:  # an example the base's chat template cannot render or mask; the core names it
        raise invalid(f"{file_label}: {exc}",
                      param=param, code="invalid_file") from None
    context = base_context(base)
    for line, n in zip(state.line_numbers, counts, strict=True):
        if n > context:
            raise invalid(f"{file_label}, line {line}: the example is {n} tokens with the chat template of base "
                          f"{base.slug!r}, whose context is {context} tokens. Shorten or split it.",
                          param=param, code="example_too_long")
    return sum(counts)


class JsonlUploadHandler(FileUploadHandler):
    """Checks the `file` field's lines as the request body arrives, before Django has spooled it whole: the first
    bad line stops the upload (the rest of the body is read and discarded) and `upload_refusal` says why."""

    def new_file(self, field_name, *args, **kwargs):
        super().new_file(field_name, *args, **kwargs)
        self.state = JsonlScan() if field_name == "file" else None

    def receive_data_chunk(self, raw_data, start):
        if self.state is not None:
            try:
                self.state.feed(raw_data)
            except JsonlError as err:
                self.request.lorafleet_jsonl_error = err
                raise StopUpload(connection_reset=False) from None
        return raw_data  # on to the next handler (the temporary file)

    def file_complete(self, file_size):
        return None


def check_while_receiving(request) -> None:
    """Call in a view before touching request.POST/FILES: cap the size, then check lines as they arrive."""
    from adapters.uploads import cap_upload_size

    cap_upload_size(request, settings.LORAFLEET_FINETUNE_MAX_FILE_BYTES)
    request.upload_handlers.insert(1, JsonlUploadHandler(request))


def upload_refusal(request) -> ApiError | None:
    """Why the handlers above stopped this request's body, if they did."""
    if getattr(request, "lorafleet_upload_cut", None):
        return too_large(settings.LORAFLEET_FINETUNE_MAX_FILE_BYTES)
    err = getattr(request, "lorafleet_jsonl_error", None)
    return invalid_file(err) if err is not None else None


def create_training_file(tenant, upload, *, purpose: str, base: BaseModel | None = None) -> TrainingFile:
    """Check and store one upload; ApiError (nothing stored) when it is refused."""
    if purpose != PURPOSE:
        raise invalid(f"purpose must be {PURPOSE!r} (the only purpose this server stores files for); got "
                      f"{str(purpose)[:40]!r}.", param="purpose", code="invalid_purpose")
    max_bytes = settings.LORAFLEET_FINETUNE_MAX_FILE_BYTES
    declared = getattr(upload, "size", None)
    if isinstance(declared, int) and declared > max_bytes:
        raise too_large(max_bytes)
    filename = os.path.basename(str(getattr(upload, "name", "") or "")) or "upload.jsonl"
    state = JsonlScan(keep=base is not None)
    digest, size = hashlib.sha256(), 0
    with tempfile.TemporaryFile(dir=getattr(settings, "FILE_UPLOAD_TEMP_DIR", None)) as spool:
        try:
            for chunk in _chunks(upload):
                size += len(chunk)
                if size > max_bytes:
                    raise too_large(max_bytes)
                digest.update(chunk)
                state.feed(chunk)
                spool.write(chunk)
            state.finish()
        except JsonlError as err:
            raise invalid_file(err) from None
        if base is not None:
            check_token_lengths(base, state, file_label="The file", param="file")
        spool.flush()
        sha256 = digest.hexdigest()
        key = _store(sha256, spool)
        try:
            return TrainingFile.objects.create(tenant=tenant, filename=filename[:255], purpose=PURPOSE, sha256=sha256,
                                               storage_key=key, size_bytes=size, examples=state.count)
        except BaseException:
            _delete_if_unreferenced(key)
            raise


def _store(sha256: str, spool) -> str:
    try:
        return put_dataset(sha256, spool)
    except BlobStorageError as exc:
        log.warning("storing a dataset failed: %s", exc)
        raise ApiError(503, "storage_unavailable", "Storing the file failed; retry shortly. Nothing was stored.",
                       type="server_error", headers={"Retry-After": "5"}) from exc


def _delete_if_unreferenced(key: str) -> None:
    """Remove a dataset blob no live file and no unfinished job uses (jobs read their files when they start)."""
    try:
        with transaction.atomic():
            if TrainingFile.objects.filter(storage_key=key, deleted_at__isnull=True).exists():
                return
            in_use = FineTuningJob.objects.filter(status__in=ACTIVE_STATUSES)
            if (in_use.filter(training_file__storage_key=key).exists()
                    or in_use.filter(validation_file__storage_key=key).exists()):
                return
            delete_dataset(key)
    except Exception:  # an unreferenced orphan is harmless; a failing delete must not fail the request
        log.exception("could not delete dataset blob %s", key)


def delete_training_file(file: TrainingFile) -> None:
    """Soft-delete the row (jobs keep naming what they trained on); the bytes go once nothing live uses them."""
    with transaction.atomic():
        locked = TrainingFile.objects.select_for_update().get(pk=file.pk)
        if locked.deleted_at is None:
            locked.deleted_at = timezone.now()
            locked.save(update_fields=["deleted_at"])
    file.deleted_at = locked.deleted_at
    _delete_if_unreferenced(file.storage_key)


def read_examples(file: TrainingFile, *, file_label: str) -> JsonlScan:
    """A stored file's examples, checked again, and its bytes checked against the sha256 recorded at upload (what
    a job trains on is what its provenance names)."""
    digest = hashlib.sha256()

    def hashed(chunks: Iterable[bytes]) -> Iterable[bytes]:
        for chunk in chunks:
            digest.update(chunk)
            yield chunk

    try:
        state = scan(hashed(iter_dataset(file.storage_key)), keep=True)
    except JsonlError as err:
        raise invalid_file(err, file_label=file_label) from None
    except BlobStorageError as exc:
        log.warning("reading %s failed: %s", file.public_id, exc)
        raise ApiError(503, "storage_unavailable", f"{file_label} cannot be read from storage; retry shortly.",
                       type="server_error", headers={"Retry-After": "5"}) from exc
    if digest.hexdigest() != file.sha256:
        log.error("%s: stored bytes have sha256 %s, not %s", file.public_id, digest.hexdigest(), file.sha256)
        raise ApiError(500, "file_integrity_error", f"{file_label} in storage is not the file that was uploaded; "
                                                    f"upload it again.", type="server_error")
    return state
