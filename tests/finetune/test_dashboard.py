"""The dashboard's fine-tuning page (dashboard/views/finetune.py) through Django's test client: upload a dataset,
start a job with the defaults, watch it train (the trainer's own run_job), see its loss and its new version,
cancel; viewers read and may change nothing; another tenant's job is a 404."""
from __future__ import annotations

import re

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from tests.finetune.helpers import GOOD_EXAMPLES, jsonl

JSON = {"HTTP_ACCEPT": "application/json"}


@pytest.fixture
def ftdash(world, settings, tmp_path, ft_base_dir, monkeypatch):
    """The world's tenants (alice owns acme, bob views acme, charlie owns globex), a real tiny base to train on,
    storage under tmp_path, and the training queue recorded instead of published."""
    from types import SimpleNamespace

    from adapters.services import register_base_model

    settings.STORAGES = {**settings.STORAGES, "adapters": {"BACKEND": "adapters.storage.AtomicFileSystemStorage",
                                                           "OPTIONS": {"location": str(tmp_path / "storage")}}}
    published: list[str] = []
    monkeypatch.setattr("finetune.jobs.publish_training_job", lambda job_id, base: published.append(job_id))
    base = register_base_model("tiny-ft", ft_base_dir, display_name="Tiny FT", max_lora_rank=16)
    return SimpleNamespace(world=world, base=base, published=published, storage=tmp_path / "storage")


def as_user(client, user):
    client.force_login(user)
    return client


def upload(client, data: bytes, name: str = "train.jsonl"):
    return client.post("/fine-tuning/files/", {"file": SimpleUploadedFile(name, data)}, **JSON)


def start(client, file_id: str, **fields):
    body = {"training_file": file_id, "validation_file": "", "model": "tiny-ft", "suffix": "helper", "rank": 8,
            "n_epochs": "", "batch_size": "", "learning_rate_multiplier": "", "seed": "", **fields}
    return client.post("/fine-tuning/jobs/new/", body)


def test_owner_uploads_starts_with_defaults_and_sees_the_loss_and_the_new_version(client, ftdash):
    from finetune.models import FineTuningJob
    from finetune.trainer import run_job

    as_user(client, ftdash.world.alice)
    page = client.get("/fine-tuning/")
    assert page.status_code == 200 and b"No fine-tuning jobs yet" in page.content
    assert b'id="dataset-form"' in page.content  # an owner may upload

    reply = upload(client, jsonl(GOOD_EXAMPLES))
    assert reply.status_code == 201, reply.content
    file_id = reply.json()["id"]
    assert reply.json()["examples"] == len(GOOD_EXAMPLES)
    page = client.get("/fine-tuning/")
    assert file_id.encode() in page.content and b"Start fine-tuning" in page.content

    reply = start(client, file_id, seed="5")
    job = FineTuningJob.objects.get(tenant=ftdash.world.acme)
    assert reply.status_code == 302 and reply["Location"] == f"/fine-tuning/jobs/{job.public_id}/"
    assert ftdash.published == [job.public_id]
    # the blanks are the API's "auto": 3 epochs, batch min(8, examples), multiplier 1, rank 8 on attention
    assert (job.status, job.hyperparameters["n_epochs"], job.hyperparameters["batch_size"]) == ("queued", 3, 8)
    assert job.hyperparameters["lora_rank"] == 8 and job.created_by == ftdash.world.alice
    live = client.get(f"/fine-tuning/jobs/{job.public_id}/")
    assert b"Queued" in live.content and b'id="cancel-button"' in live.content and b"data-active" in live.content

    assert run_job(job.public_id, owner="test-trainer") == "succeeded"
    job.refresh_from_db()
    part = client.get(f"/fine-tuning/jobs/{job.public_id}/?part=live")
    assert part.status_code == 200 and b"<html" not in part.content  # the fragment the page swaps in
    text = part.content.decode()
    assert "Succeeded" in text and f"New version {job.fine_tuned_model}" in text
    assert f'href="/adapters/{job.result_version.adapter_id}/"' in text
    points = re.search(r'<polyline class="line-a" points="([^"]+)"', text).group(1).split()
    assert len(points) == job.result_version.provenance.steps == 6  # 12 examples / 8 a batch = 2 steps, 3 epochs
    assert "step 6 of 6, training loss" in text
    full = client.get(f"/fine-tuning/jobs/{job.public_id}/")
    assert b'id="cancel-button"' not in full.content and b"data-active" not in full.content
    # the adapter's page says which job made the version, and links back to it
    adapter_page = client.get(f"/adapters/{job.result_version.adapter_id}/").content.decode()
    assert f'trained by <a href="/fine-tuning/jobs/{job.public_id}/">{job.public_id}</a>: seed 5, 6 steps' in adapter_page


def test_a_bad_dataset_is_refused_with_the_line_and_nothing_is_stored(client, ftdash):
    from finetune.models import TrainingFile

    as_user(client, ftdash.world.alice)
    reply = upload(client, jsonl(GOOD_EXAMPLES[:2]) + b'{"messages": [{"role": "user", "content": "hi"}]\n')
    assert reply.status_code == 400
    assert "line 3" in reply.json()["error"]
    assert not TrainingFile.objects.exists()
    assert not [p for p in ftdash.storage.rglob("*") if p.is_file()]
    # without JavaScript: the same refusal as a message on the page
    reply = client.post("/fine-tuning/files/", {"file": SimpleUploadedFile("x.jsonl", b"not json\n")}, follow=True)
    assert b"Dataset refused" in reply.content and b"line 1" in reply.content


def test_a_refused_job_says_why_on_the_page_and_queues_nothing(client, ftdash):
    from finetune.models import FineTuningJob

    as_user(client, ftdash.world.alice)
    file_id = upload(client, jsonl(GOOD_EXAMPLES)).json()["id"]
    reply = start(client, file_id, rank="32")  # above the base's max rank 16
    assert reply.status_code == 400 and b"Job refused" in reply.content and b"rank" in reply.content
    assert not FineTuningJob.objects.exists() and ftdash.published == []


def test_cancel_a_queued_job(client, ftdash):
    from finetune.models import FineTuningJob
    from finetune.trainer import run_job

    as_user(client, ftdash.world.alice)
    file_id = upload(client, jsonl(GOOD_EXAMPLES)).json()["id"]
    start(client, file_id)
    job = FineTuningJob.objects.get()
    reply = client.post(f"/fine-tuning/jobs/{job.public_id}/cancel/", follow=True)
    assert b"is cancelled" in reply.content and b"Cancelled" in reply.content
    job.refresh_from_db()
    assert job.status == "cancelled"
    assert run_job(job.public_id, owner="test-trainer") == "skipped"  # a trainer that gets it later does nothing
    assert job.result_version_id is None


def test_a_viewer_reads_but_changes_nothing(client, ftdash):
    from finetune.models import FineTuningJob

    as_user(client, ftdash.world.alice)
    file_id = upload(client, jsonl(GOOD_EXAMPLES)).json()["id"]
    start(client, file_id)
    job = FineTuningJob.objects.get()
    client.logout()
    as_user(client, ftdash.world.bob)
    page = client.get("/fine-tuning/")
    assert page.status_code == 200 and job.public_id.encode() in page.content
    assert b'id="dataset-form"' not in page.content and b'id="job-form"' not in page.content
    detail = client.get(f"/fine-tuning/jobs/{job.public_id}/")
    assert detail.status_code == 200 and b'id="cancel-button"' not in detail.content
    assert upload(client, jsonl(GOOD_EXAMPLES)).status_code == 403
    assert start(client, file_id).status_code == 403
    assert client.post(f"/fine-tuning/jobs/{job.public_id}/cancel/").status_code == 403
    assert FineTuningJob.objects.get().status == "queued" and FineTuningJob.objects.count() == 1


def test_another_tenants_job_is_a_404_and_its_files_are_not_offered(client, ftdash):
    from finetune.models import FineTuningJob

    as_user(client, ftdash.world.alice)
    file_id = upload(client, jsonl(GOOD_EXAMPLES)).json()["id"]
    start(client, file_id)
    job = FineTuningJob.objects.get()
    client.logout()
    as_user(client, ftdash.world.charlie)  # globex
    assert client.get(f"/fine-tuning/jobs/{job.public_id}/").status_code == 404
    assert client.get(f"/fine-tuning/jobs/{job.public_id}/?part=live").status_code == 404
    assert client.post(f"/fine-tuning/jobs/{job.public_id}/cancel/").status_code == 404
    page = client.get("/fine-tuning/")
    assert job.public_id.encode() not in page.content and file_id.encode() not in page.content
    reply = start(client, file_id)  # acme's file named by globex: not one of its choices
    assert reply.status_code == 400 and not FineTuningJob.objects.filter(tenant=ftdash.world.globex).exists()
    assert FineTuningJob.objects.get().status == "queued"
