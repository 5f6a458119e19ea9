"""POST/GET /v1/fine_tuning/jobs, cancel and events: a job is validated against its base before it is queued; each
refusal is a 4xx naming the problem with nothing recorded or queued; another tenant's job is a 404 everywhere."""
from __future__ import annotations

import datetime as dt
import json

import pytest
from django.utils import timezone

from finetune.models import FineTuneLimits, FineTuningJob, JobStatus, TrainingFile

from .helpers import GOOD_EXAMPLES, auth, example, jsonl, upload

pytestmark = pytest.mark.django_db


def create(client, secret: str, **body):
    return client.post("/v1/fine_tuning/jobs", json.dumps(body), content_type="application/json", **auth(secret))


@pytest.fixture
def training_file(client, ft) -> str:
    return upload(client, ft.acme_key, jsonl(GOOD_EXAMPLES)).json()["id"]


def test_a_job_is_validated_recorded_and_queued_on_its_bases_training_queue(client, ft, training_file):
    r = create(client, ft.acme_key, model="tiny-ft", training_file=training_file, suffix="adder", seed=7,
               hyperparameters={"n_epochs": 2, "batch_size": "auto"})
    assert r.status_code == 200, r.content
    job = r.json()
    assert job["id"].startswith("ftjob-") and job["object"] == "fine_tuning.job" and job["status"] == "queued"
    assert job["model"] == "tiny-ft" and job["training_file"] == training_file and job["seed"] == 7
    assert job["hyperparameters"] == {"n_epochs": 2, "batch_size": 8, "learning_rate_multiplier": 1.0}
    assert job["fine_tuned_model"] is None and job["error"] is None and job["user_provided_suffix"] == "adder"
    assert job["lorafleet"]["lora"] == {"rank": 8, "alpha": 16.0,
                                        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    assert job["lorafleet"]["estimated_tokens"] > 2 * len(GOOD_EXAMPLES) * 10
    assert ft.published == [(job["id"], "tiny-ft")]
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", **auth(ft.acme_key)).json()["data"]
    assert [e["object"] for e in events] == ["fine_tuning.job.event"] * 2
    assert events[1]["message"].startswith("Validating training file") and "queued" in events[0]["message"]


def test_method_supervised_and_the_lora_extension_are_read(client, ft, training_file):
    r = create(client, ft.acme_key, model="tiny-ft", training_file=training_file,
               method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 3,
                                                                                 "learning_rate_multiplier": 2}}},
               lora={"rank": 4, "alpha": 8, "target_modules": ["v_proj", "q_proj", "down_proj"]}, auto_activate=True)
    assert r.status_code == 200, r.content
    job = r.json()
    assert job["hyperparameters"] == {"n_epochs": 1, "batch_size": 3, "learning_rate_multiplier": 2.0}
    assert job["lorafleet"]["lora"] == {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    assert job["lorafleet"]["auto_activate"] is True and job["user_provided_suffix"].startswith("ft-")


def _refused(client, ft, status: int, code: str, param: str | None, **body):
    before = FineTuningJob.objects.count()
    r = create(client, ft.acme_key, **body)
    assert r.status_code == status, r.content
    error = r.json()["error"]
    assert error["code"] == code and (param is None or error["param"] == param), error
    assert FineTuningJob.objects.count() == before and ft.published == []
    return error["message"]


def test_bad_requests_name_the_problem_and_queue_nothing(client, ft, training_file):
    ok = {"model": "tiny-ft", "training_file": training_file}
    _refused(client, ft, 400, "missing_parameter", "model", training_file=training_file)
    _refused(client, ft, 404, "model_not_found", "model", **{**ok, "model": "no-such-base"})
    _refused(client, ft, 404, "file_not_found", "training_file", **{**ok, "training_file": "file-nope"})
    _refused(client, ft, 404, "file_not_found", "validation_file", **ok, validation_file="file-nope")
    message = _refused(client, ft, 400, "rank_too_large", "lora.rank", **ok, lora={"rank": 32})
    assert "16" in message
    _refused(client, ft, 400, "invalid_parameter", "lora.target_modules", **ok, lora={"target_modules": ["lm_head"]})
    _refused(client, ft, 400, "invalid_parameter", "hyperparameters.n_epochs", **ok, hyperparameters={"n_epochs": 0})
    _refused(client, ft, 400, "invalid_parameter", "hyperparameters.momentum", **ok, hyperparameters={"momentum": 1})
    _refused(client, ft, 400, "unsupported_method", "method.type", **ok, method={"type": "dpo"})
    _refused(client, ft, 400, "invalid_parameter", "suffix", **ok, suffix="no spaces please")
    _refused(client, ft, 400, "unknown_parameter", None, **ok, learning_rate=0.1)


def test_another_tenants_file_and_a_base_the_tenant_may_not_use_are_404(client, ft, training_file):
    r = create(client, ft.globex_key, model="tiny-ft", training_file=training_file)
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"
    ft.acme.may_use_base = False
    ft.acme.save()
    message = _refused(client, ft, 404, "model_not_found", "model", model="tiny-ft", training_file=training_file)
    assert "may not fine-tune it" in message
    assert FineTuningJob.objects.count() == 0 and ft.published == []


def test_a_line_over_the_bases_context_is_refused_at_job_creation(client, ft):
    long_answer = " ".join(f"word{i}" for i in range(600))
    file_id = upload(client, ft.acme_key, jsonl([*GOOD_EXAMPLES[:2], example("Say a lot", long_answer)])).json()["id"]
    message = _refused(client, ft, 400, "example_too_long", "training_file", model="tiny-ft", training_file=file_id)
    assert f"training_file {file_id}, line 3" in message and "context is 512 tokens" in message


def test_limits_refuse_with_their_own_codes(client, ft, training_file):
    ok = {"model": "tiny-ft", "training_file": training_file}
    limits = FineTuneLimits.objects.create(tenant=ft.acme, max_concurrent_jobs=1, max_tokens_per_job=10,
                                           max_tokens_per_day=10**9)
    assert "limit per job is 10" in _refused(client, ft, 400, "job_tokens_limit", "training_file", **ok)
    limits.max_tokens_per_job = 10**9
    limits.save()
    assert create(client, ft.acme_key, **ok).status_code == 200
    ft.published.clear()
    r = create(client, ft.acme_key, **ok)
    assert r.status_code == 429 and r.json()["error"]["code"] == "concurrent_jobs_limit" and r["Retry-After"]
    assert ft.published == []
    limits.max_concurrent_jobs, limits.max_tokens_per_day = 5, 100
    limits.save()
    r = create(client, ft.acme_key, **ok)
    assert r.status_code == 429 and r.json()["error"]["code"] == "daily_tokens_limit"
    assert FineTuningJob.objects.count() == 1 and ft.published == []
    # globex's limits are its own (the settings' defaults)
    globex_file = upload(client, ft.globex_key, jsonl(GOOD_EXAMPLES)).json()["id"]
    assert create(client, ft.globex_key, model="tiny-ft", training_file=globex_file).status_code == 200


def test_cancel_a_queued_job_and_refuse_cancelling_a_finished_one(client, ft, training_file):
    job_id = create(client, ft.acme_key, model="tiny-ft", training_file=training_file).json()["id"]
    r = client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", **auth(ft.acme_key))
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["finished_at"]
    assert client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", **auth(ft.acme_key)).json()["status"] == "cancelled"
    FineTuningJob.objects.filter(public_id=job_id).update(status=JobStatus.FAILED)
    r = client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", **auth(ft.acme_key))
    assert r.status_code == 400 and r.json()["error"]["code"] == "job_not_cancellable"


def test_another_tenants_job_is_404_everywhere(client, ft, training_file):
    job_id = create(client, ft.acme_key, model="tiny-ft", training_file=training_file).json()["id"]
    for method, path in (("get", f"/v1/fine_tuning/jobs/{job_id}"), ("post", f"/v1/fine_tuning/jobs/{job_id}/cancel"),
                         ("get", f"/v1/fine_tuning/jobs/{job_id}/events")):
        r = getattr(client, method)(path, **auth(ft.globex_key))
        assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found", (method, path)
    assert client.get("/v1/fine_tuning/jobs", **auth(ft.globex_key)).json()["data"] == []
    assert [j["id"] for j in client.get("/v1/fine_tuning/jobs", **auth(ft.acme_key)).json()["data"]] == [job_id]
    assert FineTuningJob.objects.get(public_id=job_id).status == "queued"


def test_a_running_job_whose_trainer_stopped_beating_is_failed_when_asked_about(client, ft, training_file, settings):
    job_id = create(client, ft.acme_key, model="tiny-ft", training_file=training_file).json()["id"]
    stale = timezone.now() - dt.timedelta(seconds=settings.LORAFLEET_TRAINER_HEARTBEAT_TTL_S + 5)
    FineTuningJob.objects.filter(public_id=job_id).update(status=JobStatus.RUNNING, trainer_id="trainer-x@h:1",
                                                          heartbeat_at=stale)
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", **auth(ft.acme_key)).json()
    assert job["status"] == "failed" and job["error"]["code"] == "trainer_lost"
    assert "trainer-x@h:1" in job["error"]["message"] and job["fine_tuned_model"] is None


def test_a_key_bound_to_an_adapter_fine_tunes_only_that_adapter(client, ft, training_file):
    from adapters.services import create_adapter
    from gateway.services import issue_api_key

    adapter = create_adapter(ft.acme, "support", ft.base)
    _, bound = issue_api_key(ft.acme, "bound", bound_adapter=adapter)
    r = create(client, bound, model="tiny-ft", training_file=training_file, suffix="something-else")
    assert r.status_code == 403 and r.json()["error"]["code"] == "key_bound_to_adapter"
    assert FineTuningJob.objects.count() == 0 and ft.published == []
    r = create(client, bound, model="tiny-ft", training_file=training_file)
    assert r.status_code == 200 and r.json()["user_provided_suffix"] == "support"


def test_a_suffix_naming_an_adapter_of_another_base_is_refused(client, ft, training_file, ft_base_dir):
    from adapters.services import create_adapter, register_base_model

    other = register_base_model("tiny-other", ft_base_dir)
    create_adapter(ft.acme, "elsewhere", other)
    message = _refused(client, ft, 400, "adapter_base_mismatch", "suffix", model="tiny-ft",
                       training_file=training_file, suffix="elsewhere")
    assert "tiny-other" in message


def test_a_stored_file_whose_bytes_changed_is_never_trained_on(client, ft, training_file):
    stored = TrainingFile.objects.get(public_id=training_file)
    path = ft.storage / stored.storage_key
    path.write_bytes(path.read_bytes().replace(b"plus", b"minus"))
    r = create(client, ft.acme_key, model="tiny-ft", training_file=training_file)
    assert r.status_code == 500 and r.json()["error"]["code"] == "file_integrity_error"
    assert FineTuningJob.objects.count() == 0 and ft.published == []
