"""The S3 storage path against a real S3 API (moto's server, tests/support/s3_server.py), not the filesystem backend.

Storage is configured as production configures it: config/settings.py run with the variables docker-compose.yml
sets for MinIO (LORAFLEET_STORAGE=s3, AWS_*), pointed at the test's server. Uploads land in the bucket under their
sha256; a worker's engine fetches them through its loader (inference_worker.worker.load_blob, django-storages +
boto3) and verifies the hash; a missing object, a bucket the credentials may not use and a bucket that does not
exist each answer a clear code, record nothing and leave no object behind. Under `.ci/run` (CI=true) a missing
moto server fails these tests instead of skipping them.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from adapters.models import AdapterVersion
from adapters.storage import BlobStorageError, read_blob, storage_key_for
from adapters.uploads import create_adapter_version
from protocol.errors import ErrorCode
from tests.conftest import require_service
from tests.support.s3_server import MOTO_SERVER, S3Server

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    require_service("moto's S3 server (moto[server], the dev extra)", MOTO_SERVER.exists())
    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log").start()
    yield server
    server.stop()


def adapters_storage_from_settings(env: dict[str, str]) -> dict:
    """STORAGES["adapters"] as config/settings.py builds it from `env` (a fresh process: settings read env once)."""
    code = "import json; from config import settings; print(json.dumps(settings.STORAGES['adapters']))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def use_s3(s3, settings):
    """use_s3(user, bucket=None): the "adapters" storage on the test server with that IAM user's credentials.
    Starts as the admin, on an empty bucket."""
    for key in s3.keys():
        s3.client("s3").delete_object(Bucket=s3.bucket, Key=key)
    configs: dict[tuple, dict] = {}

    def use(user: str = "admin", bucket: str | None = None) -> None:
        if (user, bucket) not in configs:
            configs[(user, bucket)] = adapters_storage_from_settings(s3.env(user, bucket))
        settings.STORAGES = {**settings.STORAGES, "adapters": configs[(user, bucket)]}

    use()
    return use


def upload(adapter, folder: Path, **kwargs) -> AdapterVersion:
    with open(folder / "adapter_config.json", "rb") as cfg, open(folder / "adapter_model.safetensors", "rb") as weights:
        return create_adapter_version(adapter, config_file=cfg, weights_file=weights, **kwargs)


@pytest.fixture
def engine_for(tiny_base_dir):
    """engine_for(): a worker's engine on the tiny base whose loader is the worker's own (storage -> bytes)."""
    from inference_worker.engine import Engine
    from inference_worker.model import ModelRunner
    from inference_worker.worker import load_blob

    engines = []

    def make():
        engine = Engine(ModelRunner(tiny_base_dir, pool_pages=256, max_lora_rank=16), load_blob).start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


def generate(engine, version: AdapterVersion, request_id: str):
    from gateway.serving import adapter_ref
    from protocol.jobs import GenerationJob

    job = GenerationJob(request_id, adapter_ref(version.adapter.name, version), prompt="Hello there", max_tokens=4,
                        temperature=0.0)
    return engine.generate(job, timeout=120)


# --- configuration ----------------------------------------------------------------------------


def test_settings_build_the_s3_storage_from_the_variables_compose_sets(s3):
    env = s3.env()
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert set(env) <= set(compose["x-lorafleet-env"])  # compose hands web and worker these very variables
    assert compose["x-lorafleet-env"]["LORAFLEET_STORAGE"] == "s3"
    config = adapters_storage_from_settings(env)
    assert config["BACKEND"] == "storages.backends.s3.S3Storage"
    options = config["OPTIONS"]
    assert (options["bucket_name"], options["endpoint_url"], options["region_name"]) == (
        s3.bucket, s3.endpoint, env["AWS_S3_REGION_NAME"])
    assert (options["access_key"], options["secret_key"]) == (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    assert options["file_overwrite"] is False  # content keys are never overwritten


# --- uploads ----------------------------------------------------------------------------------


def test_an_upload_lands_in_the_bucket_under_its_sha256(use_s3, s3, adapter, peft_adapters):
    weights = (peft_adapters.good / "adapter_model.safetensors").read_bytes()
    version = upload(adapter, peft_adapters.good)
    assert version.sha256 == hashlib.sha256(weights).hexdigest()
    assert version.storage_key == storage_key_for(version.sha256)
    assert s3.keys() == [version.storage_key]  # one object, under its content's hash, nothing else (no partials)
    stored = s3.client("s3").get_object(Bucket=s3.bucket, Key=version.storage_key)["Body"].read()
    assert stored == weights

    # the same bytes again (another version): the blob is reused, not rewritten or duplicated
    modified = s3.client("s3").head_object(Bucket=s3.bucket, Key=version.storage_key)["LastModified"]
    again = upload(adapter, peft_adapters.good)
    assert again.number == 2 and again.storage_key == version.storage_key
    assert s3.keys() == [version.storage_key]
    assert s3.client("s3").head_object(Bucket=s3.bucket, Key=version.storage_key)["LastModified"] == modified

    other = upload(adapter, peft_adapters.good_other)
    assert s3.keys() == sorted([version.storage_key, other.storage_key])


# --- a worker fetches and verifies ------------------------------------------------------------


def test_a_worker_fetches_the_blob_from_the_bucket_and_verifies_its_hash(use_s3, s3, adapter, peft_adapters,
                                                                         engine_for):
    version = upload(adapter, peft_adapters.good)
    engine = engine_for()
    result = generate(engine, version, "s3-fetch")
    assert result.ok, (result.error_code, result.error_message)
    assert result.adapter_sha256 == version.sha256  # the hash of what the worker read from S3 and checked
    assert engine.cache.counters["cold_loads"] == 1


def test_a_tampered_object_is_refused_by_the_worker(use_s3, s3, adapter, peft_adapters, engine_for):
    version = upload(adapter, peft_adapters.good)
    other = (peft_adapters.good_other / "adapter_model.safetensors").read_bytes()
    s3.client("s3").put_object(Bucket=s3.bucket, Key=version.storage_key, Body=other)  # someone rewrote the object
    result = generate(engine_for(), version, "s3-tampered")
    assert result.status == "error" and result.error_code == ErrorCode.ADAPTER_INTEGRITY_ERROR
    assert version.sha256[:12] in result.error_message


# --- a missing object -------------------------------------------------------------------------


def test_a_missing_object_is_a_clear_load_failure_and_nothing_stale_is_kept(use_s3, s3, adapter, peft_adapters,
                                                                            engine_for):
    version = upload(adapter, peft_adapters.good)
    weights = (peft_adapters.good / "adapter_model.safetensors").read_bytes()
    s3.client("s3").delete_object(Bucket=s3.bucket, Key=version.storage_key)

    with pytest.raises(BlobStorageError) as missing:
        read_blob(version.storage_key)
    assert missing.value.code == "blob_missing"
    assert str(missing.value) == f"adapter blob {version.storage_key} is not in storage (FileNotFoundError)."

    engine = engine_for()
    result = generate(engine, version, "s3-missing")
    assert result.status == "error" and result.error_code == ErrorCode.ADAPTER_LOAD_FAILED
    assert "is not in storage" in result.error_message and "botocore" not in result.error_message

    s3.client("s3").put_object(Bucket=s3.bucket, Key=version.storage_key, Body=weights)  # restored
    result = generate(engine, version, "s3-restored")  # the failed load left nothing behind: it loads now
    assert result.ok and result.adapter_sha256 == version.sha256


# --- a bucket the credentials may not use, a bucket that does not exist -------------------------


def test_a_denied_bucket_refuses_the_upload_with_a_code_and_records_nothing(use_s3, s3, adapter, peft_adapters):
    use_s3("reader")  # may list and read objects, may not write them: the PUT is refused
    with pytest.raises(BlobStorageError) as denied:
        upload(adapter, peft_adapters.good)
    assert denied.value.code == "storage_denied"
    assert "storage refused access with these credentials (AccessDenied)" in str(denied.value)
    assert "An error occurred" not in str(denied.value)  # no library text
    assert not AdapterVersion.objects.filter(adapter=adapter).exists()
    assert s3.keys() == []  # nothing half-written

    use_s3("nobody")  # may do nothing at all: refused at the first request (the existence check)
    with pytest.raises(BlobStorageError) as nobody:
        upload(adapter, peft_adapters.good)
    assert nobody.value.code == "storage_denied"
    assert not AdapterVersion.objects.filter(adapter=adapter).exists() and s3.keys() == []


def test_the_dashboard_answers_a_denied_bucket_with_its_code(use_s3, s3, adapter, peft_adapters, client):
    from django.urls import reverse

    use_s3("reader")
    client.force_login(adapter.created_by)
    folder = peft_adapters.good
    with open(folder / "adapter_config.json", "rb") as cfg, open(folder / "adapter_model.safetensors", "rb") as w:
        response = client.post(reverse("adapters:upload", args=[adapter.pk]),
                               {"config_file": cfg, "weights_file": w}, HTTP_ACCEPT="application/json")
    assert response.status_code == 503
    body = response.json()
    assert body["ok"] is False and body["field"] == "storage" and body["code"] == "storage_denied"
    assert "nothing was recorded" in body["error"] and "AccessDenied" not in body["error"]
    assert not AdapterVersion.objects.filter(adapter=adapter).exists() and s3.keys() == []


def test_a_missing_bucket_refuses_the_upload_with_its_code(use_s3, s3, adapter, peft_adapters):
    use_s3("admin", bucket="no-such-bucket")
    with pytest.raises(BlobStorageError) as missing:
        upload(adapter, peft_adapters.good)
    assert missing.value.code == "storage_bucket_missing"
    assert not AdapterVersion.objects.filter(adapter=adapter).exists() and s3.keys() == []


def test_a_worker_denied_the_bucket_fails_the_request_clearly(use_s3, s3, adapter, peft_adapters, engine_for):
    version = upload(adapter, peft_adapters.good)
    use_s3("nobody")
    with pytest.raises(BlobStorageError) as denied:
        read_blob(version.storage_key)
    assert denied.value.code == "storage_denied"
    result = generate(engine_for(), version, "s3-denied")
    assert result.status == "error" and result.error_code == ErrorCode.ADAPTER_LOAD_FAILED
    assert "storage refused access" in result.error_message
    assert s3.keys() == [version.storage_key]  # the object is untouched
