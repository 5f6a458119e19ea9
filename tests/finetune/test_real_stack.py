"""Fine-tuning on the real stack, with the official `openai` client: gunicorn, an inference worker and a trainer
(`manage.py run_trainer`), each its own process, over PostgreSQL and Redis; nothing stubbed.

files.create -> fine_tuning.jobs.create -> retrieve/list_events until succeeded -> chat.completions with
job.fine_tuned_model answers, token for token what transformers + PEFT answer greedily with the stored adapter.
Cancel mid-run leaves no version; SIGKILL of the trainer mid-run leaves a failed job and no version.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
from types import SimpleNamespace

import pytest

from tests.e2e.conftest import (
    ADMIN_DB_URL,
    PYTHON,
    REDIS_URL,
    REPO,
    Proc,
    Stack,
    _db_url,
    _reachable,
    _require,
    pg_connect,
    wait_until,
)

from .helpers import jsonl

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]

HEARTBEAT_TTL_S = 6  # a killed trainer's job is failed this long after its last beat
QUESTIONS = [f"What is {a} plus {b}?" for a in range(4) for b in range(4)]
EXAMPLES = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "Four, I think."}]}
            for q in QUESTIONS]

SEED = """
from adapters.services import register_base_model
from finetune.models import FineTuneLimits
from gateway.services import issue_api_key
from tenants.services import create_tenant
import sys
base = register_base_model(BASE_SLUG, CHECKPOINT, max_lora_rank=16, queue_name="ft.e2e." + SUFFIX)
result = {"base": base.slug, "keys": {}}
for letter in ("a", "b", "c"):
    tenant = create_tenant(f"ft-{letter}-{SUFFIX}", f"Tenant {letter}")
    if letter == "c":
        tenant.may_use_base = False
        tenant.save()
    FineTuneLimits.objects.create(tenant=tenant, max_concurrent_jobs=3, max_tokens_per_job=10**7,
                                  max_tokens_per_day=10**8)
    result["keys"][letter] = issue_api_key(tenant, "e2e")[1]
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    _require(f"PostgreSQL at {ADMIN_DB_URL}", _reachable(ADMIN_DB_URL, 5432))
    _require(f"Redis at {REDIS_URL}", _reachable(REDIS_URL, 6379))
    root = tmp_path_factory.mktemp("ft_e2e")
    suffix = secrets.token_hex(3)
    db_name = f"lorafleet_ft_{suffix}"
    with pg_connect(ADMIN_DB_URL) as admin:
        admin.execute(f'CREATE DATABASE "{db_name}"')
    env = {
        **os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONPATH": str(REPO),
        "DATABASE_URL": _db_url(db_name), "CELERY_BROKER_URL": REDIS_URL, "LORAFLEET_VAR_DIR": str(root / "var"),
        "LORAFLEET_STORAGE_DIR": str(root / "storage"), "LORAFLEET_LOG_LEVEL": "WARNING", "TRITON_INTERPRET": "1",
        "LORAFLEET_TRAINER_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S), "OMP_NUM_THREADS": "1",
    }
    env.pop("CELERY_RESULT_BACKEND", None)
    s = Stack(root, env)
    try:
        out = subprocess.run([PYTHON, "manage.py", "migrate", "--noinput"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        from demo.tiny_base import build_tiny_base

        checkpoint = build_tiny_base(root / "tiny", arch="llama", seed=11)
        slug = f"ft-{suffix}"
        seed = s.django(f"BASE_SLUG, CHECKPOINT, SUFFIX = {slug!r}, {str(checkpoint)!r}, {suffix!r}\n" + SEED)
        s.start_web()
        worker = s.start_worker(slug)
        trainer = start_trainer(s, slug)
        yield SimpleNamespace(stack=s, url=s.web_url, root=root, checkpoint=checkpoint, slug=slug, keys=seed["keys"],
                              worker=worker, trainer=trainer, env=env)
    finally:
        s.close()
        with pg_connect(ADMIN_DB_URL) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


def start_trainer(s: Stack, slug: str) -> Proc:
    proc = Proc("trainer", [PYTHON, "manage.py", "run_trainer", "--base", slug, "--loglevel", "INFO"], s.env, s.root)
    s.procs.append(proc)
    wait_until(lambda: "ready" in proc.tail(20000), 120, "trainer ready", (proc,))
    return proc


def client_for(stack, letter: str = "a"):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.keys[letter], max_retries=0, timeout=120)


def wait_for_status(client, job_id: str, statuses: tuple[str, ...], timeout: float, procs=()):
    def check():
        job = client.fine_tuning.jobs.retrieve(job_id)
        return job if job.status in statuses else None

    return wait_until(check, timeout, f"job {job_id} to reach {statuses}", procs)


def versions_of(stack, name: str) -> dict:
    return stack.stack.django(
        "from adapters.models import Adapter, AdapterVersion\n"
        f"vs = AdapterVersion.objects.filter(adapter__name={name!r}).order_by('number')\n"
        "result = {'adapter': Adapter.objects.filter(name=" + repr(name) + ").exists(), 'versions': [\n"
        "  {'number': v.number, 'storage_key': v.storage_key, 'peft_config': v.peft_config, 'sha256': v.sha256,\n"
        "   'provenance': getattr(getattr(v, 'provenance', None), 'job_public_id', None)} for v in vs]}")


def greedy_with_peft(stack, version: dict, messages: list[dict], max_new_tokens: int) -> list[int]:
    """transformers + PEFT on the stored adapter (its blob and its recorded config), greedy."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = stack.root / f"oracle-{version['sha256'][:12]}"
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(version["peft_config"]))
    (folder / "adapter_model.safetensors").write_bytes((stack.root / "storage" / version["storage_key"]).read_bytes())
    tok = AutoTokenizer.from_pretrained(str(stack.checkpoint))
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(stack.checkpoint), dtype=torch.float32), str(folder)).eval()
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    new = out[0, len(ids):].tolist()
    return new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new


def test_the_openai_client_fine_tunes_and_the_new_model_answers_as_peft_does(stack):
    client = client_for(stack)
    uploaded = client.files.create(file=("adder.jsonl", jsonl(EXAMPLES)), purpose="fine-tune")
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(jsonl(EXAMPLES))
    assert client.files.retrieve(uploaded.id).filename == "adder.jsonl"

    job = client.fine_tuning.jobs.create(
        model=stack.slug, training_file=uploaded.id, suffix="adder", seed=5,
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "n_epochs": 3, "batch_size": 4, "learning_rate_multiplier": 50}}})
    assert job.status in ("queued", "running") and job.hyperparameters.n_epochs == 3 and job.seed == 5
    done = wait_for_status(client, job.id, ("succeeded", "failed", "cancelled"), 300,
                           (stack.trainer, stack.stack.web))
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model == "adder@1" and done.trained_tokens > 0 and done.finished_at
    assert [j.id for j in client.fine_tuning.jobs.list(limit=10)] == [job.id]

    events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
    metrics = [e for e in events if e.type == "metrics"]
    assert len(metrics) == 12 and all(e.data["train_loss"] > 0 for e in metrics)  # 16 examples / 4 x 3 epochs
    messages = [e.message for e in events]
    assert messages[0] == "The job has successfully completed"
    assert any(m.startswith("New fine-tuned model created: adder@1") for m in messages)
    assert any(m.startswith("Validating training file") for m in messages)

    question = [{"role": "user", "content": "What is 2 plus 3?"}]
    chat = client.chat.completions.create(model=done.fine_tuned_model, messages=question, max_tokens=12,
                                          temperature=0, logprobs=True, top_logprobs=1,
                                          extra_body={"return_tokens_as_token_ids": True})
    served = [int(e.token[len("token_id:"):]) for e in chat.choices[0].logprobs.content]
    assert chat.model == "adder@1" and chat.choices[0].message.content
    version = versions_of(stack, "adder")["versions"][0]
    assert chat.model_extra["lorafleet"]["weights_sha256"] == version["sha256"] and version["provenance"] == job.id
    reference = greedy_with_peft(stack, version, question, 12)
    assert reference and served[: len(reference)] == reference and len(served) in (len(reference), len(reference) + 1)
    base = client.chat.completions.create(model=f"base/{stack.slug}", messages=question, max_tokens=12, temperature=0)
    assert base.choices[0].message.content != chat.choices[0].message.content  # the training changed the answer


def test_bad_inputs_are_4xx_naming_the_problem_through_the_client(stack):
    client = client_for(stack)
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("bad.jsonl", jsonl(EXAMPLES[:2]) + b"{not json}\n"), purpose="fine-tune")
    assert err.value.code == "invalid_file" and "line 3" in err.value.message
    good = client.files.create(file=("ok.jsonl", jsonl(EXAMPLES)), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError) as err:  # another tenant's file
        client_for(stack, "b").fine_tuning.jobs.create(model=stack.slug, training_file=good.id)
    assert err.value.code == "file_not_found"
    c = client_for(stack, "c")
    c_file = c.files.create(file=("ok.jsonl", jsonl(EXAMPLES)), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError) as err:  # a base tenant c may not use
        c.fine_tuning.jobs.create(model=stack.slug, training_file=c_file.id)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.fine_tuning.jobs.create(model=stack.slug, training_file=good.id, extra_body={"lora": {"rank": 64}})
    assert err.value.code == "rank_too_large"
    assert list(client_for(stack, "b").fine_tuning.jobs.list()) == []
    with pytest.raises(openai.NotFoundError):
        client_for(stack, "b").files.retrieve(good.id)


def _long_job(stack, client, suffix: str):
    uploaded = client.files.create(file=("long.jsonl", jsonl(EXAMPLES)), purpose="fine-tune")
    return client.fine_tuning.jobs.create(model=stack.slug, training_file=uploaded.id, suffix=suffix, seed=1,
                                          hyperparameters={"n_epochs": 50, "batch_size": 1})


def _first_metrics(client, job_id: str, procs) -> None:
    wait_until(lambda: any(e.type == "metrics" for e in client.fine_tuning.jobs.list_events(job_id, limit=5)), 180,
               f"the first training step of {job_id}", procs)


def test_cancel_mid_run_leaves_a_cancelled_job_and_no_version(stack):
    client = client_for(stack)
    job = _long_job(stack, client, "cancel-me")
    _first_metrics(client, job.id, (stack.trainer,))
    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.fine_tuned_model is None
    wait_until(lambda: any(e.message.startswith("Training stopped at step")
                           for e in client.fine_tuning.jobs.list_events(job.id, limit=10)), 60,
               "the trainer to stop", (stack.trainer,))
    assert client.fine_tuning.jobs.retrieve(job.id).status == "cancelled"
    assert versions_of(stack, "cancel-me") == {"adapter": False, "versions": []}


def test_sigkill_of_the_trainer_mid_run_fails_the_job_and_leaves_no_version(stack):
    client = client_for(stack)
    job = _long_job(stack, client, "killed")
    _first_metrics(client, job.id, (stack.trainer,))
    stack.trainer.kill()  # SIGKILL to its process group
    failed = wait_for_status(client, job.id, ("failed",), HEARTBEAT_TTL_S + 60)
    assert failed.error.code == "trainer_lost" and failed.fine_tuned_model is None
    assert versions_of(stack, "killed") == {"adapter": False, "versions": []}
    # a new trainer takes the next job as usual
    stack.trainer = start_trainer(stack.stack, stack.slug)
    uploaded = client.files.create(file=("again.jsonl", jsonl(EXAMPLES[:4])), purpose="fine-tune")
    again = client.fine_tuning.jobs.create(model=stack.slug, training_file=uploaded.id, suffix="after-kill",
                                           hyperparameters={"n_epochs": 1, "batch_size": 4})
    assert wait_for_status(client, again.id, ("succeeded", "failed"), 180, (stack.trainer,)).status == "succeeded"
