"""The upload service end to end, with adapters written by PEFT on a tiny base built locally.

Every refusal is checked for three things a user (and an operator) would notice: the message names
the culprit, no AdapterVersion row exists, and the storage folder is empty.
"""
from __future__ import annotations

import hashlib
import io
import pickle
import shutil
import struct
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import call_command

from adapters.models import AdapterVersion
from adapters.storage import BlobStorageError, read_blob, storage_key_for
from adapters.uploads import AdapterDeleted, create_adapter_version, spool_weights
from adapters.validation import AdapterValidationError

pytestmark = pytest.mark.django_db


def stored_files(location: Path) -> list[str]:
    """Every file in the adapter storage folder, as storage keys."""
    return sorted(str(p.relative_to(location)) for p in location.rglob("*") if p.is_file())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_refused(excinfo, field: str, *fragments: str, blob_dir: Path) -> None:
    err = excinfo.value
    assert err.field == field, (err.field, str(err))
    for fragment in fragments:
        assert fragment in str(err), (fragment, str(err))
    assert AdapterVersion.objects.count() == 0
    assert stored_files(blob_dir) == []


def test_a_good_adapter_lands_with_its_row_blob_and_derived_facts(adapter, peft_adapters, upload, blob_dir, alice):
    weights = peft_adapters.good / "adapter_model.safetensors"
    version = upload(adapter, peft_adapters.good, created_by=alice)

    version.refresh_from_db()
    assert version.number == 1
    assert version.sha256 == _sha256(weights)
    assert version.storage_key == storage_key_for(version.sha256)
    assert version.size_bytes == weights.stat().st_size
    assert (version.rank, version.alpha, version.use_rslora) == (8, 16.0, False)
    assert version.target_modules == ["q_proj", "v_proj"]
    assert version.dtype == "float32"
    # 2 layers × (q: A 8×64 + B 64×8, v: A 8×64 + B 32×8)
    assert version.parameter_count == 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8)
    assert version.created_by == alice
    assert stored_files(blob_dir) == [version.storage_key]
    assert read_blob(version.storage_key) == weights.read_bytes()
    adapter.refresh_from_db()
    assert adapter.active_version == version  # the first version goes live
    assert adapter.pointer_changes.get().to_version == version


def test_versions_count_up_and_only_the_first_goes_live_unless_asked(adapter, peft_adapters, upload, blob_dir):
    v1 = upload(adapter, peft_adapters.good)
    v2 = upload(adapter, peft_adapters.good_other)
    adapter.refresh_from_db()
    assert (v1.number, v2.number) == (1, 2)
    assert adapter.active_version == v1
    assert (v2.rank, v2.use_rslora, v2.dtype) == (4, True, "bfloat16")
    assert v2.target_modules == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    v3 = upload(adapter, peft_adapters.good, activate=True)
    adapter.refresh_from_db()
    assert v3.number == 3 and adapter.active_version == v3
    # v1 and v3 hold the same bytes: one blob, shared, never rewritten.
    assert v3.storage_key == v1.storage_key
    assert stored_files(blob_dir) == sorted([v1.storage_key, v2.storage_key])


def test_django_uploaded_files_are_accepted(adapter, peft_adapters, blob_dir):
    folder = peft_adapters.good
    version = create_adapter_version(
        adapter,
        config_file=SimpleUploadedFile("adapter_config.json", (folder / "adapter_config.json").read_bytes()),
        weights_file=SimpleUploadedFile("adapter_model.safetensors",
                                        (folder / "adapter_model.safetensors").read_bytes()),
    )
    assert version.sha256 == _sha256(folder / "adapter_model.safetensors")


class _Canary:
    """Unpickling this creates a directory: proof that someone loaded the pickle."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        import os
        return (os.mkdir, (str(self.path),))


@pytest.mark.parametrize("weights_name", ["adapter_model.bin", "adapter_model.safetensors"])
def test_a_pickle_is_refused_by_name_and_content_and_never_unpickled(
    adapter, peft_adapters, upload, blob_dir, tmp_path, weights_name
):
    canary = tmp_path / "canary-created-by-unpickling"
    folder = tmp_path / "evil"
    folder.mkdir()
    shutil.copy(peft_adapters.good / "adapter_config.json", folder)
    (folder / weights_name).write_bytes(pickle.dumps({"lora": _Canary(canary)}, protocol=4))

    with pytest.raises(AdapterValidationError) as excinfo:
        upload(adapter, folder, weights_name=weights_name)
    _assert_refused(excinfo, "adapter_model.safetensors", "pickle", blob_dir=blob_dir)
    assert not canary.exists()
    pickle.loads((folder / weights_name).read_bytes())  # the canary works: loading *would* have fired
    assert canary.exists()


def test_a_torch_save_zip_is_refused(adapter, peft_adapters, upload, blob_dir, tmp_path):
    import torch

    folder = tmp_path / "torchsave"
    folder.mkdir()
    shutil.copy(peft_adapters.good / "adapter_config.json", folder)
    torch.save({"w": torch.ones(2)}, folder / "adapter_model.safetensors")
    with pytest.raises(AdapterValidationError) as excinfo:
        upload(adapter, folder)
    _assert_refused(excinfo, "adapter_model.safetensors", "zip archive", blob_dir=blob_dir)


def test_wrong_shapes_name_the_tensor_and_the_expected_shape(adapter, peft_adapters, upload, blob_dir):
    with pytest.raises(AdapterValidationError) as excinfo:
        upload(adapter, peft_adapters.wrong_shapes)
    name = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
    _assert_refused(excinfo, name, f"tensor {name} has shape [64, 8], expected [32, 8] "
                                   f"(out_features 32 × rank 8)", blob_dir=blob_dir)


def test_rank_over_the_bases_cap_is_refused(adapter, peft_adapters, upload, blob_dir):
    with pytest.raises(AdapterValidationError) as excinfo:
        upload(adapter, peft_adapters.rank_over_cap)
    _assert_refused(excinfo, "r", "rank 32 is over this base model's maximum LoRA rank of 16", blob_dir=blob_dir)


def test_modules_to_save_is_refused(adapter, peft_adapters, upload, blob_dir):
    with pytest.raises(AdapterValidationError) as excinfo:
        upload(adapter, peft_adapters.modules_to_save)
    _assert_refused(excinfo, "modules_to_save", "modules_to_save", blob_dir=blob_dir)


def test_an_adapter_matching_no_module_is_refused(adapter, peft_adapters, upload, blob_dir):
    with pytest.raises(AdapterValidationError) as excinfo:
        upload(adapter, peft_adapters.no_match)
    _assert_refused(excinfo, "base_model.model.layers.0.self_attn.q_proj.lora_A.weight",
                    "does not match any module of the base model", blob_dir=blob_dir)


def test_an_oversize_file_is_refused(adapter, peft_adapters, upload, blob_dir, settings):
    settings.LORAFLEET_MAX_UPLOAD_BYTES = 10_000  # the good adapter is ~15 KB
    with pytest.raises(AdapterValidationError) as excinfo:
        upload(adapter, peft_adapters.good)
    _assert_refused(excinfo, "adapter_model.safetensors", "upload limit of 9.8 KB", blob_dir=blob_dir)


class _EndlessStream:
    """A body that never ends (a "10 GB" upload): counts what the server reads from it."""

    def __init__(self):
        self.consumed = 0

    def read(self, n: int = -1) -> bytes:
        n = 1 << 20 if n is None or n < 0 else n
        self.consumed += n
        return b"\0" * n


def test_an_endless_stream_is_cut_off_at_the_cap(adapter, peft_adapters, blob_dir, settings):
    settings.LORAFLEET_MAX_UPLOAD_BYTES = 5 * 1024 * 1024
    stream = _EndlessStream()
    with open(peft_adapters.good / "adapter_config.json", "rb") as cfg:
        with pytest.raises(AdapterValidationError) as excinfo:
            create_adapter_version(adapter, config_file=cfg, weights_file=stream)
    _assert_refused(excinfo, "adapter_model.safetensors", "upload limit of 5.0 MB", blob_dir=blob_dir)
    assert stream.consumed <= 6 * 1024 * 1024


def test_spooling_a_large_file_keeps_memory_bounded(tmp_path):
    import tracemalloc

    class Body:
        left = 64 * 1024 * 1024

        def read(self, n):
            n = min(n, self.left)
            self.left -= n
            return b"\x01" * n

    with open(tmp_path / "spool", "w+b") as dest:
        tracemalloc.start()
        try:
            sha, size = spool_weights(Body(), dest, max_bytes=1 << 30)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert size == 64 * 1024 * 1024
    assert sha == hashlib.sha256(b"\x01" * size).hexdigest()
    assert peak < 8 * 1024 * 1024, peak


def test_a_truncated_safetensors_is_refused(adapter, peft_adapters, upload, blob_dir, tmp_path):
    folder = tmp_path / "truncated"
    shutil.copytree(peft_adapters.good, folder)
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(AdapterValidationError) as excinfo:
        upload(adapter, folder)
    assert "truncated" in str(excinfo.value)
    _assert_refused(excinfo, excinfo.value.field, blob_dir=blob_dir)


def test_a_huge_header_is_refused_before_it_is_read(adapter, peft_adapters, upload, blob_dir, tmp_path):
    folder = tmp_path / "huge_header"
    folder.mkdir()
    shutil.copy(peft_adapters.good / "adapter_config.json", folder)
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{" + b" " * 1000)
    with pytest.raises(AdapterValidationError) as excinfo:
        upload(adapter, folder)
    _assert_refused(excinfo, "adapter_model.safetensors", "declares 1099511627776 bytes; the limit is",
                    blob_dir=blob_dir)


def test_nan_weights_are_refused_naming_the_tensor(adapter, peft_adapters, upload, blob_dir):
    with pytest.raises(AdapterValidationError) as excinfo:
        upload(adapter, peft_adapters.nan)
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    _assert_refused(excinfo, name, f"tensor {name} contains NaN or Inf (element {3 * 8 + 5})", blob_dir=blob_dir)


def test_a_storage_failure_half_way_leaves_no_row_and_no_partial_blob(
    adapter, peft_adapters, upload, blob_dir, monkeypatch
):
    from adapters.storage import AtomicFileSystemStorage

    def half_then_fail(self, name, content):
        path = Path(self.path(name))
        path.parent.mkdir(parents=True, exist_ok=True)
        content.seek(0)
        path.write_bytes(content.read(1000))  # a partial object, as an interrupted write leaves
        raise OSError("disk full")

    monkeypatch.setattr(AtomicFileSystemStorage, "_save", half_then_fail)  # a backend that is not atomic
    with pytest.raises(BlobStorageError, match="disk full"):
        upload(adapter, peft_adapters.good)
    assert AdapterVersion.objects.count() == 0
    assert stored_files(blob_dir) == []


def test_a_failure_after_the_blob_was_written_removes_the_blob(adapter, peft_adapters, upload, blob_dir, monkeypatch):
    import adapters.uploads

    def boom(*args, **kwargs):
        raise RuntimeError("database went away")

    monkeypatch.setattr(adapters.uploads, "activate_version", boom)
    with pytest.raises(RuntimeError, match="database went away"):
        upload(adapter, peft_adapters.good)
    assert AdapterVersion.objects.count() == 0
    assert stored_files(blob_dir) == []


def test_a_failure_never_deletes_a_blob_another_version_uses(adapter, peft_adapters, upload, blob_dir, monkeypatch):
    import adapters.uploads

    v1 = upload(adapter, peft_adapters.good)
    monkeypatch.setattr(adapters.uploads, "activate_version", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        upload(adapter, peft_adapters.good, activate=True)
    assert list(AdapterVersion.objects.values_list("number", flat=True)) == [1]
    assert stored_files(blob_dir) == [v1.storage_key]


def test_a_corrupt_unreferenced_blob_under_the_key_is_replaced(adapter, peft_adapters, upload, blob_dir):
    sha = _sha256(peft_adapters.good / "adapter_model.safetensors")
    leftover = blob_dir / storage_key_for(sha)
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half a file from a crashed upload")
    version = upload(adapter, peft_adapters.good)
    assert read_blob(version.storage_key) == (peft_adapters.good / "adapter_model.safetensors").read_bytes()


class _PausingReader(io.BytesIO):
    """A slow upload: after its first chunk is read, waits until `resume` is set."""

    def __init__(self, data: bytes, first_chunk_read, resume):
        super().__init__(data)
        self.first_chunk_read, self.resume = first_chunk_read, resume

    def read(self, size=-1):
        chunk = super().read(size)
        if self.tell() > 0 and not self.first_chunk_read.is_set():
            self.first_chunk_read.set()
            assert self.resume.wait(timeout=30)
        return chunk


def test_a_blob_being_written_is_invisible_to_a_concurrent_identical_upload(blob_dir):
    """The first writer stalls half way; the second (same bytes) must neither see half a blob nor fail.

    With Django's plain FileSystemStorage the second writer found the first's partial file under the
    key, took it for a crashed upload's leftover, deleted it and failed the first upload (CI, stop 22).
    """
    import threading

    from adapters.storage import put_blob

    data = bytes(range(256)) * 4096 * 2  # 2 MiB: many chunks
    sha = hashlib.sha256(data).hexdigest()
    first_chunk_read, resume = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def slow_writer():
        try:
            results["slow"] = put_blob(sha, _PausingReader(data, first_chunk_read, resume))
        except Exception as exc:  # reported by the assertions below
            results["slow"] = exc

    slow = threading.Thread(target=slow_writer)
    slow.start()
    assert first_chunk_read.wait(timeout=30)
    try:
        assert not (blob_dir / storage_key_for(sha)).exists()  # half written: not under its key
        assert put_blob(sha, io.BytesIO(data)) == (storage_key_for(sha), True)
    finally:
        resume.set()
        slow.join(timeout=30)
    assert results["slow"] == (storage_key_for(sha), False)  # found the other's blob, reused it
    assert read_blob(storage_key_for(sha)) == data
    assert stored_files(blob_dir) == [storage_key_for(sha)]  # no temporary or renamed file left


def test_the_filesystem_storage_never_overwrites_a_name(blob_dir):
    from django.core.files.base import ContentFile

    from adapters.storage import adapter_storage

    storage = adapter_storage()
    assert storage.save("adapters/x/a.bin", ContentFile(b"first")) == "adapters/x/a.bin"
    other = storage.save("adapters/x/a.bin", ContentFile(b"second"))
    assert other != "adapters/x/a.bin"
    assert (blob_dir / "adapters/x/a.bin").read_bytes() == b"first"
    assert (blob_dir / other).read_bytes() == b"second"
    assert oct((blob_dir / other).stat().st_mode & 0o777) == oct(0o644)


def test_a_deleted_adapter_refuses_uploads(adapter, peft_adapters, upload, blob_dir):
    from adapters.services import soft_delete_adapter

    soft_delete_adapter(adapter)
    with pytest.raises(AdapterDeleted) as excinfo:
        upload(adapter, peft_adapters.good)
    _assert_refused(excinfo, "adapter", "deleted", blob_dir=blob_dir)


def test_upload_adapter_command_creates_the_adapter_and_prints_version_and_sha(
    base, alice, peft_adapters, blob_dir
):
    from tenants.services import create_tenant

    create_tenant("globex", "Globex", owner=alice)
    out = io.StringIO()
    call_command("upload_adapter", "globex", "writer", str(peft_adapters.good), "--base", "tiny", stdout=out)
    sha = _sha256(peft_adapters.good / "adapter_model.safetensors")
    assert "version 1" in out.getvalue() and sha in out.getvalue()
    out = io.StringIO()
    call_command("upload_adapter", "globex", "writer", str(peft_adapters.good_other), "--base", "tiny", stdout=out)
    assert "version 2" in out.getvalue()
    assert AdapterVersion.objects.filter(adapter__name="writer").count() == 2


def test_upload_adapter_command_reports_a_refusal(base, alice, peft_adapters, blob_dir):
    from django.core.management.base import CommandError

    from tenants.services import create_tenant

    create_tenant("globex", "Globex", owner=alice)
    with pytest.raises(CommandError, match="rank 32 is over"):
        call_command("upload_adapter", "globex", "writer", str(peft_adapters.rank_over_cap), "--base", "tiny")
    assert stored_files(blob_dir) == []


@pytest.mark.django_db(transaction=True)
def test_concurrent_uploads_get_distinct_consecutive_numbers(postgres, adapter, peft_adapters, blob_dir):
    """Four uploads at once (real transactions, PostgreSQL row lock): numbers 1–4, no duplicate, no gap."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    def one(i: int) -> int:
        try:
            folder = peft_adapters.good if i % 2 else peft_adapters.good_other
            with open(folder / "adapter_config.json", "rb") as cfg, \
                    open(folder / "adapter_model.safetensors", "rb") as weights:
                return create_adapter_version(adapter, config_file=cfg, weights_file=weights).number
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=4) as pool:
        numbers = sorted(pool.map(one, range(4)))
    assert numbers == [1, 2, 3, 4]
    adapter.refresh_from_db()
    assert adapter.active_version.number == 1
    assert adapter.pointer_changes.count() == 1  # only the first to take the lock went live
    assert len(stored_files(blob_dir)) == 2  # two distinct contents, each stored once


def _writers_of_two_tenants(base, alice):
    """An adapter named "writer" in each of two tenants: uploads of the same bytes share one blob."""
    from adapters.services import create_adapter
    from tenants.services import create_tenant

    return (create_adapter(create_tenant("acme", "Acme", owner=alice), "writer", base),
            create_adapter(create_tenant("globex", "Globex", owner=alice), "writer", base))


def _wait_for_a_version_of(key: str, seconds: float = 3.0) -> None:
    """Give a concurrent upload up to `seconds` to record a version of blob `key` (the interleaving forced)."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not AdapterVersion.objects.filter(storage_key=key).exists():
        time.sleep(0.05)


def _upload_as_a_then_b(upload, writers, folder, b_may_start, a_is_done=None) -> dict[str, object]:
    """Upload `folder` on thread "A" to writers[0] and, once `b_may_start` is set, on thread "B" to writers[1];
    each one's AdapterVersion, or the exception it raised."""
    import threading

    from django.db import connection

    outcome: dict[str, object] = {}

    def run(name: str, adapter) -> None:
        try:
            outcome[name] = upload(adapter, folder)
        except Exception as exc:
            outcome[name] = exc
        finally:
            if name == "A" and a_is_done is not None:
                a_is_done.set()
            connection.close()

    a = threading.Thread(target=run, args=("A", writers[0]), name="A")
    a.start()
    assert b_may_start.wait(timeout=30)
    b = threading.Thread(target=run, args=("B", writers[1]), name="B")
    b.start()
    a.join(timeout=60)
    b.join(timeout=60)
    return outcome


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("b_records", ["after A's clean-up", "while A cleans up"])
def test_a_failed_upload_never_deletes_the_blob_a_concurrent_identical_upload_reused(
    postgres, base, alice, peft_adapters, upload, blob_dir, monkeypatch, b_records
):
    """A fails after storing; B (same bytes, another tenant) found A's blob and records its version either
    after A's clean-up or between A's "no version uses it" and its delete.

    A's clean-up must not leave B's version pointing at nothing: B's version has its weights.
    """
    import threading

    import adapters.uploads

    writers = _writers_of_two_tenants(base, alice)
    a_stored, b_found_the_blob, a_is_done = threading.Event(), threading.Event(), threading.Event()
    a_deleting = threading.Event()
    put_blob, activate_version = adapters.uploads.put_blob, adapters.uploads.activate_version
    delete_blob = adapters.uploads.delete_blob
    b_go = a_is_done if b_records == "after A's clean-up" else a_deleting

    def put_blob_then_let_a_fail(sha256, content):
        result = put_blob(sha256, content)
        if threading.current_thread().name == "A":
            a_stored.set()
        if threading.current_thread().name == "B" and not b_found_the_blob.is_set():
            b_found_the_blob.set()
            assert b_go.wait(timeout=30)
        return result

    def delete_after_b_recorded(key):
        """A has found no version using the blob; give B time to record one before deleting."""
        a_deleting.set()
        _wait_for_a_version_of(key)
        delete_blob(key)

    def activation_fails_for_a(*args, **kwargs):
        if threading.current_thread().name == "A":
            assert b_found_the_blob.wait(timeout=30)
            raise RuntimeError("database went away")
        return activate_version(*args, **kwargs)

    monkeypatch.setattr(adapters.uploads, "put_blob", put_blob_then_let_a_fail)
    monkeypatch.setattr(adapters.uploads, "activate_version", activation_fails_for_a)
    monkeypatch.setattr(adapters.uploads, "delete_blob", delete_after_b_recorded)
    outcome = _upload_as_a_then_b(upload, writers, peft_adapters.good, a_stored, a_is_done)  # B once A's blob exists
    assert isinstance(outcome["A"], RuntimeError)
    version = outcome["B"]
    assert isinstance(version, AdapterVersion)
    assert read_blob(version.storage_key) == (peft_adapters.good / "adapter_model.safetensors").read_bytes()
    assert stored_files(blob_dir) == [version.storage_key]


@pytest.mark.django_db(transaction=True)
def test_two_uploads_replacing_one_corrupt_leftover_never_lose_the_blob_a_version_uses(
    postgres, base, alice, peft_adapters, upload, blob_dir, monkeypatch
):
    """A crashed upload left half a blob under the key. A and B (same bytes, two tenants) both find it. A has
    checked that no version uses it and is about to delete it when B replaces it and records a version; then
    A's own write fails. B's version must still have its weights: the replacement is serialized with the
    recording, so A cannot delete a blob that B's version uses."""
    import threading

    import adapters.uploads

    weights = (peft_adapters.good / "adapter_model.safetensors").read_bytes()
    leftover = blob_dir / storage_key_for(hashlib.sha256(weights).hexdigest())
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half a file from a crashed upload")
    writers = _writers_of_two_tenants(base, alice)
    a_replacing = threading.Event()
    put_blob, delete_blob = adapters.uploads.put_blob, adapters.uploads.delete_blob
    puts = {"A": 0}

    def a_deletes_once_b_has_recorded(key):
        """A has found no version using the leftover; give B time to record one before deleting."""
        if threading.current_thread().name == "A":
            a_replacing.set()
            _wait_for_a_version_of(key)
        delete_blob(key)

    def a_second_write_fails(sha256, content):
        if threading.current_thread().name == "A":
            puts["A"] += 1
            if puts["A"] == 2:  # the write that replaces the leftover
                raise OSError(28, "No space left on device")
        return put_blob(sha256, content)

    monkeypatch.setattr(adapters.uploads, "delete_blob", a_deletes_once_b_has_recorded)
    monkeypatch.setattr(adapters.uploads, "put_blob", a_second_write_fails)
    outcome = _upload_as_a_then_b(upload, writers, peft_adapters.good, a_replacing)  # B while A is about to delete
    version = outcome["B"]
    assert isinstance(version, AdapterVersion), version
    assert read_blob(version.storage_key) == weights
    assert stored_files(blob_dir) == [version.storage_key]
    assert isinstance(outcome["A"], BlobStorageError), outcome["A"]  # A's failure is said, as a storage error
    assert "No space left on device" in str(outcome["A"])


class _CountingStream:
    """Wraps a request's body stream and records how much of it the server read."""

    def __init__(self, stream):
        self.stream = stream
        self.consumed = 0

    def read(self, *args):
        chunk = self.stream.read(*args)
        self.consumed += len(chunk)
        return chunk

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _multipart_request(rf, weights: bytes, *, declared_length: int | None = None):
    request = rf.post("/upload", {
        "config_file": SimpleUploadedFile("adapter_config.json", b"{}"),
        "weights_file": SimpleUploadedFile("adapter_model.safetensors", weights),
    })
    stream = request._stream = _CountingStream(request._stream)
    if declared_length is not None:
        request.META["CONTENT_LENGTH"] = str(declared_length)
    return request, stream


def test_the_http_body_stops_being_read_at_the_cap(rf):
    """SizeCappedUploadHandler: a multipart body over the cap is not read to its end."""
    from adapters.uploads import cap_upload_size, upload_cut_error

    request, stream = _multipart_request(rf, b"\0" * (8 * 1024 * 1024))
    cap_upload_size(request, max_bytes=1024 * 1024)
    assert "weights_file" not in request.FILES
    err = upload_cut_error(request)
    assert err is not None and "upload limit of 1.0 MB" in str(err)
    assert stream.consumed < 3 * 1024 * 1024  # of 8 MB sent


def test_a_declared_length_far_over_the_cap_reads_nothing(rf):
    from adapters.uploads import cap_upload_size, upload_cut_error

    request, stream = _multipart_request(rf, b"\0" * 1024, declared_length=10 * 1024**3)
    cap_upload_size(request, max_bytes=1024 * 1024)
    assert not request.FILES
    assert upload_cut_error(request) is not None
    assert stream.consumed == 0


def test_a_body_under_the_cap_parses_normally(rf):
    from adapters.uploads import cap_upload_size, upload_cut_error

    request, _ = _multipart_request(rf, b"\1" * 4096)
    cap_upload_size(request, max_bytes=1024 * 1024)
    assert request.FILES["weights_file"].read() == b"\1" * 4096
    assert upload_cut_error(request) is None
