"""`manage.py demo_setup` — the step `make demo` runs before starting web and worker.

One module-scoped run with short training budgets (the real demo trains up to a minute, and up to
twenty seconds per adapter); every test reads what that run left: the database rows, var/demo-style files,
and the answers the serving engine gives with the uploaded adapters.
"""
from __future__ import annotations

import json
import re
import stat
import uuid

import pytest
from django.core.management import call_command

from demo import training

PROMPT = "What did you do today?"
STORY_OPENING = "One day, Anna"
pytestmark = pytest.mark.timeout(480)


@pytest.fixture(scope="module")
def demo(django_db_setup, django_db_blocker, tmp_path_factory):
    """Runs demo_setup once, against the test database and a temporary storage and demo folder."""
    from django.test import override_settings

    root = tmp_path_factory.mktemp("demo")
    storages = {
        "default": {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(root / "media")}},
        "adapters": {"BACKEND": "django.core.files.storage.FileSystemStorage",
                     "OPTIONS": {"location": str(root / "storage")}},
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }
    # The suite's autouse fixture makes tests hash passwords with MD5 (fast); the module-scoped run
    # must hash the same way, or the tests' authenticate() could not read what it stored.
    fast_hashers = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    with override_settings(STORAGES=storages, PASSWORD_HASHERS=fast_hashers), django_db_blocker.unblock():
        out = []
        # Budgets in steps, not seconds (the clock caps are set out of reach): the result is then the
        # same on a busy machine as on an idle one, so the assertions below cannot flake.
        call_command("demo_setup", "--dir", str(root / "demo"), "--base-steps", "150", "--adapter-steps", "40",
                     "--base-seconds", "600", "--adapter-seconds", "600", "--no-progress", stdout=_Sink(out))
        answers = _answers(root / "demo" / "base")
        yield {"root": root, "dir": root / "demo", "log": "".join(out), "answers": answers, "storages": storages}
        _delete_demo_rows()


class _Sink:
    def __init__(self, lines: list[str]):
        self.lines = lines

    def write(self, s: str) -> None:
        self.lines.append(s)

    def flush(self) -> None:
        pass


def _answers(base_dir) -> dict[str, str]:
    """Greedy answers to PROMPT from the base and from each demo adapter's live version, via the engine."""
    from adapters.models import Adapter
    from adapters.storage import read_blob
    from inference_worker.engine import Engine
    from inference_worker.jobs import AdapterRef, GenerationJob
    from inference_worker.model import ModelRunner

    runner = ModelRunner(base_dir, pool_pages=512, max_lora_rank=16)
    prompt = runner.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                  tokenize=False)
    jobs = {"base": GenerationJob(request_id="base", adapter=None, prompt=prompt, max_tokens=24, temperature=0.0),
            # The base continuing a story opening: enough words to tell language from noise.
            "base-story": GenerationJob(request_id="base-story", adapter=None, prompt=STORY_OPENING, max_tokens=48,
                                        temperature=0.0, ignore_eos=True)}
    for adapter in Adapter.objects.select_related("active_version", "tenant").filter(base__slug="tiny-demo"):
        v = adapter.active_version
        ref = AdapterRef(version_id=v.pk, sha256=v.sha256, storage_key=v.storage_key, rank=v.rank, alpha=v.alpha,
                         use_rslora=v.use_rslora, target_modules=list(v.target_modules), name=adapter.name)
        jobs[adapter.name] = GenerationJob(request_id=uuid.uuid4().hex, adapter=ref, prompt=prompt, max_tokens=24,
                                           temperature=0.0)
    engine = Engine(runner, read_blob).start()
    try:
        handles = {name: engine.submit(job) for name, job in jobs.items()}  # one mixed batch, as served
        results = {name: h.result(timeout=60) for name, h in handles.items()}
    finally:
        engine.stop()
    for name, r in results.items():
        assert r.ok, f"{name}: {r.error_code} {r.error_message}"
    return {name: r.text for name, r in results.items()}


def _delete_demo_rows() -> None:
    """The module fixture ran outside a test transaction: leave the test database as it found it."""
    from django.contrib.auth import get_user_model

    from adapters.models import Adapter, AdapterVersion, BaseModel, VersionPointerChange
    from tenants.models import ApiKey, Membership, Tenant

    ApiKey.objects.all().delete()
    VersionPointerChange.objects.all().delete()
    Adapter.objects.update(active_version=None)
    AdapterVersion.objects.all().delete()
    Adapter.objects.all().delete()
    Membership.objects.all().delete()
    Tenant.objects.all().delete()
    BaseModel.objects.all().delete()
    get_user_model().objects.all().delete()


@pytest.fixture
def demo_db(demo, db):
    return demo


def test_the_three_adapters_answer_the_same_prompt_differently(demo):
    """The demo's point: one base, and each tenant's weights visibly change the answer."""
    answers = demo["answers"]
    styled = {name: answers[name] for name in ("shouty", "lister", "echo")}
    assert all(text.strip() for text in styled.values()), answers
    assert len(set(styled.values())) == 3, answers
    assert all(text != answers["base"] for text in styled.values()), answers


def test_the_trained_base_produces_corpus_words_not_noise(demo):
    """The base continues a story opening in words of its corpus, not byte soup."""
    words = demo["answers"]["base-story"].split()
    assert len(words) >= 10, demo["answers"]["base-story"]
    vocabulary = training.corpus_vocabulary()
    known = [w for w in words if re.sub(r"[^a-z']", "", w.lower()) in vocabulary]
    assert len(known) / len(words) > 0.5, demo["answers"]["base-story"]


def test_it_registers_the_base_and_uploads_real_versions(demo_db):
    from adapters.models import Adapter, BaseModel
    from adapters.storage import blob_sha256

    base = BaseModel.objects.get(slug="tiny-demo")
    assert base.checkpoint_path == str(demo_db["dir"] / "base")
    owned = {(a.tenant.slug, a.name): a for a in Adapter.objects.select_related("tenant")}
    assert set(owned) == {("acme", "shouty"), ("acme", "lister"), ("globex", "echo")}
    shouty = owned[("acme", "shouty")]
    versions = list(shouty.versions.order_by("number"))
    assert [v.number for v in versions] == [1, 2]
    assert versions[0].sha256 != versions[1].sha256  # v1 and v2 are different weights: rollback shows it
    assert shouty.active_version == versions[1]
    for adapter in owned.values():
        assert blob_sha256(adapter.active_version.storage_key) == adapter.active_version.sha256


def test_it_writes_logins_and_keys_that_work_to_a_private_file(demo_db):
    from django.contrib.auth import authenticate

    from tenants.keys import authenticate_api_key
    from tenants.models import Membership

    path = demo_db["dir"] / "keys.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    state = json.loads(path.read_text())
    for tenant in ("acme", "globex"):
        assert authenticate_api_key(state["api_keys"][tenant], touch=False).tenant.slug == tenant
    for username in ("admin", "alice", "bob", "charlie"):
        assert authenticate(username=username, password=state["logins"][username]) is not None
    roles = {(m.user.username, m.tenant.slug): m.role for m in Membership.objects.select_related("user", "tenant")}
    assert roles == {("alice", "acme"): "owner", ("bob", "acme"): "viewer", ("charlie", "globex"): "owner"}
    assert state["adapters"] == {"acme": ["shouty", "lister"], "globex": ["echo"]}


def test_running_it_again_changes_nothing(demo_db):
    """Idempotent: no retraining, no new versions, the same keys."""
    from django.test import override_settings

    from adapters.models import AdapterVersion

    before = json.loads((demo_db["dir"] / "keys.json").read_text())
    versions = set(AdapterVersion.objects.values_list("sha256", flat=True))
    out: list[str] = []
    with override_settings(STORAGES=demo_db["storages"]):
        call_command("demo_setup", "--dir", str(demo_db["dir"]), "--no-progress", stdout=_Sink(out))
    log = "".join(out)
    assert "not training again" in log and "steps in" not in log, log
    assert set(AdapterVersion.objects.values_list("sha256", flat=True)) == versions
    assert json.loads((demo_db["dir"] / "keys.json").read_text()) == before
