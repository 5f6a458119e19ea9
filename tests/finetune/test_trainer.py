"""The trainer glue (finetune/trainer.py) in-process, with the real training core on the tiny base: a job becomes an
ordinary adapter version with its provenance; a cancelled or failed job leaves no version; a redelivered message
never runs a job twice."""
from __future__ import annotations

import pytest

from adapters.models import Adapter, AdapterVersion
from finetune import jobs as job_service
from finetune import training
from finetune.models import AdapterProvenance, FineTuningJob, JobEvent
from finetune.params import JobParams
from finetune.trainer import run_job

from .helpers import GOOD_EXAMPLES, auth, jsonl, upload

pytestmark = pytest.mark.django_db(transaction=True)

OWNER = "trainer-test@here:1"


def _job(client, ft, **params) -> FineTuningJob:
    file_id = upload(client, ft.acme_key, jsonl(GOOD_EXAMPLES)).json()["id"]
    spec = JobParams(model="tiny-ft", training_file=file_id, n_epochs=1, batch_size=4, seed=3, **params)
    return job_service.create_job(ft.acme, spec)


def test_a_job_becomes_a_live_adapter_version_with_its_provenance(client, ft):
    job = _job(client, ft, suffix="adder", validation_file=None)
    assert run_job(job.public_id, owner=OWNER) == "succeeded"
    job.refresh_from_db()
    version = AdapterVersion.objects.get(adapter__tenant=ft.acme, adapter__name="adder")
    assert job.fine_tuned_model == "adder@1" and job.result_version == version and job.trained_tokens > 0
    assert version.adapter.active_version == version  # the first version goes live
    assert version.rank == 8 and version.alpha == 16 and version.target_modules == ["k_proj", "o_proj", "q_proj",
                                                                                     "v_proj"]
    p = version.provenance
    assert p.job_public_id == job.public_id and p.training_file_sha256 == job.training_file.sha256
    assert p.base_sha256 == ft.base.sha256 and p.seed == 3 and p.hyperparameters == job.hyperparameters
    assert p.steps == 3 and p.train_loss > 0 and p.trainer_version.startswith(training.TRAINER_VERSION)
    metrics = list(JobEvent.objects.filter(job=job, type="metrics").order_by("id"))
    assert [e.data["step"] for e in metrics] == [1, 2, 3] and all(e.data["train_loss"] > 0 for e in metrics)
    messages = [e.message for e in JobEvent.objects.filter(job=job).order_by("id")]
    assert messages[-2].startswith("New fine-tuned model created: adder@1") and messages[-1].endswith("completed")
    # the API shows the result
    body = client.get(f"/v1/fine_tuning/jobs/{job.public_id}", **auth(ft.acme_key)).json()
    assert body["status"] == "succeeded" and body["fine_tuned_model"] == "adder@1"
    assert body["lorafleet"]["weights_sha256"] == version.sha256


def test_a_second_job_adds_a_version_that_waits_for_activation_unless_auto_activate(client, ft):
    for _ in range(2):
        run_job(_job(client, ft, suffix="adder").public_id, owner=OWNER)
    adapter = Adapter.objects.get(tenant=ft.acme, name="adder")
    assert sorted(adapter.versions.values_list("number", flat=True)) == [1, 2]
    # the same file, seed and settings: byte-identical weights (one blob, two versions with their own provenance)
    assert len(set(adapter.versions.values_list("sha256", flat=True))) == 1
    assert adapter.active_version.number == 1
    last = FineTuningJob.objects.filter(suffix="adder").order_by("-id").first()
    assert "not live yet" in JobEvent.objects.filter(job=last, message__startswith="New fine-tuned").get().message
    run_job(_job(client, ft, suffix="adder", auto_activate=True).public_id, owner=OWNER)
    adapter.refresh_from_db()
    assert adapter.active_version.number == 3


def test_cancel_mid_run_stops_between_steps_and_leaves_no_version(client, ft):
    job = _job(client, ft, suffix="cancelled-one")
    job.hyperparameters["n_epochs"] = 5
    job.save(update_fields=["hyperparameters"])

    class CancelAfterFirstStep:
        TRAINER_VERSION, Cancelled, TrainSettings = training.TRAINER_VERSION, training.Cancelled, training.TrainSettings

        @staticmethod
        def train_lora(*args, on_event, should_cancel, **kwargs):
            def cancel_on_first_metrics(event):
                on_event(event)
                if event["type"] == "metrics" and event["step"] == 1:
                    job_service.cancel_job(ft.acme, job.public_id)  # as POST .../cancel does

            def asked():
                import time

                time.sleep(0.6)  # past the trainer's poll interval
                return should_cancel()

            return training.train_lora(*args, on_event=cancel_on_first_metrics, should_cancel=asked, **kwargs)

    assert run_job(job.public_id, owner=OWNER, core=CancelAfterFirstStep) == "cancelled"
    job.refresh_from_db()
    assert job.status == "cancelled" and job.result_version is None and job.fine_tuned_model == ""
    assert not Adapter.objects.filter(name="cancelled-one").exists() and not AdapterProvenance.objects.exists()
    steps = [e.data["step"] for e in JobEvent.objects.filter(job=job, type="metrics")]
    assert steps and max(steps) < 15  # 5 epochs x 3 steps were planned
    assert JobEvent.objects.filter(job=job, message__startswith="Training stopped at step").exists()


def test_unusable_data_fails_the_job_with_the_cores_message(client, ft):
    job = _job(client, ft, suffix="broken")

    class Refuses:
        TRAINER_VERSION, Cancelled, TrainSettings = training.TRAINER_VERSION, training.Cancelled, training.TrainSettings

        @staticmethod
        def train_lora(*args, **kwargs):
            raise ValueError("example 3 (line 3 of its file): the chat template cannot be masked")

    assert run_job(job.public_id, owner=OWNER, core=Refuses) == "failed"
    body = client.get(f"/v1/fine_tuning/jobs/{job.public_id}", **auth(ft.acme_key)).json()
    assert body["status"] == "failed" and body["error"]["code"] == "invalid_training_data"
    assert "line 3" in body["error"]["message"] and not Adapter.objects.filter(name="broken").exists()


def test_a_redelivered_message_does_not_run_a_job_twice(client, ft):
    job = _job(client, ft, suffix="once")
    assert run_job(job.public_id, owner=OWNER) == "succeeded"
    assert run_job(job.public_id, owner="trainer-other@there:2") == "skipped"
    assert AdapterVersion.objects.filter(adapter__name="once").count() == 1
    cancelled = _job(client, ft, suffix="never")
    job_service.cancel_job(ft.acme, cancelled.public_id)
    assert run_job(cancelled.public_id, owner=OWNER) == "skipped"
    assert not Adapter.objects.filter(name="never").exists()


def test_the_provenance_is_reachable_from_the_audit_row_in_admin(client, ft, admin_client):
    """audit row -> adapter version (a link on the audit page) -> its provenance on the version's page."""
    from gateway.models import AuditRecord

    job = _job(client, ft, suffix="traced")
    assert run_job(job.public_id, owner=OWNER) == "succeeded"
    version = AdapterVersion.objects.get(adapter__name="traced")
    assert AdapterProvenance.objects.filter(version=version).exists()
    row = AuditRecord.objects.create(route="chat.completions", tenant=ft.acme, adapter=version.adapter,
                                     adapter_name="traced", version=version, version_number=1)
    audit_page = admin_client.get(f"/admin/gateway/auditrecord/{row.pk}/change/").content.decode()
    assert f"/admin/adapters/adapterversion/{version.pk}/change/" in audit_page
    version_page = admin_client.get(f"/admin/adapters/adapterversion/{version.pk}/change/").content.decode()
    assert 'id="provenance-group"' in version_page and job.public_id in version_page
    assert job.training_file.sha256 in version_page and ft.base.sha256 in version_page and "n_epochs" in version_page
