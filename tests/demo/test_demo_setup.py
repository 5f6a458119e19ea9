"""`manage.py demo_setup` on SmolLM2-135M-Instruct — the step `make demo` runs before web and worker.

One module-scoped run, on the SmolLM2 import the session caches, with the demo's own training steps
(SMOLLM2.adapter_steps; fine-tuning jobs have no clock cap), so the run trains the adapters a user's demo gets,
on an idle machine as on a busy one. (At 8 steps the tests passed while the demo's rollback
version answered its question with an empty reply.) Every test reads what that run left: the database rows, the
demo folder, and the answers lorafleet's serving engine gives — each checked against transformers/PEFT.
"""
from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import pytest

from demo.plan import DEMO_ADAPTERS, SMOLLM2
from tests.support.demo import (
    adapter_ref,
    delete_demo_rows,
    demo_settings,
    engine_answers,
    live_adapters,
    run_demo_setup,
    transformers_answers,
)

MAX_TOKENS = 24
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def demo(django_db_setup, django_db_blocker, tmp_path_factory, smollm2_checkpoint):
    root = tmp_path_factory.mktemp("demo")
    demo_dir = root / "demo"
    with demo_settings(root), django_db_blocker.unblock():
        log = run_demo_setup("--base", "smollm2", "--models-dir", str(smollm2_checkpoint.parent), "--dir",
                             str(demo_dir), "--adapter-steps", str(SMOLLM2.adapter_steps))
        from adapters.models import AdapterVersion

        live = live_adapters(SMOLLM2.slug)
        shouty_v1 = AdapterVersion.objects.select_related("adapter").get(adapter__name="shouty", number=1)
        engine_asks, oracle_asks = {}, {}
        for spec in DEMO_ADAPTERS:
            question = SMOLLM2.questions[spec.name]
            ref, version = live[spec.name]
            folder = demo_dir / "adapters" / f"{spec.tenant}-{spec.name}-v{version.number}"
            assert hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).hexdigest() == version.sha256
            engine_asks |= {spec.name: (ref, question), f"base:{spec.name}": (None, question)}
            oracle_asks |= {spec.name: (folder, question), f"base:{spec.name}": (None, question)}
        engine_asks["shouty@1"] = (adapter_ref(shouty_v1), SMOLLM2.questions["shouty"])
        oracle_asks["shouty@1"] = (demo_dir / "adapters" / "acme-shouty-v1", SMOLLM2.questions["shouty"])
        ours = engine_answers(smollm2_checkpoint, engine_asks, max_tokens=MAX_TOKENS)
        theirs = transformers_answers(smollm2_checkpoint, oracle_asks, max_tokens=MAX_TOKENS)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(smollm2_checkpoint))
        texts = {label: tokenizer.decode(ids, skip_special_tokens=True).strip() for label, ids in ours.items()}
        yield {"root": root, "dir": demo_dir, "log": log, "ours": ours, "theirs": theirs, "texts": texts,
               "checkpoint": smollm2_checkpoint}
        delete_demo_rows()


@pytest.fixture
def demo_db(demo, db):
    return demo


def test_every_answer_is_what_transformers_and_peft_answer_greedily(demo):
    """The engine (paged KV cache, batched LoRA) serves exactly the tokens of the reference stack."""
    for label, ids in demo["ours"].items():
        assert ids == demo["theirs"][label], (label, demo["texts"][label])


def test_each_adapter_changes_the_answer_to_its_question(demo):
    texts = demo["texts"]
    for spec in DEMO_ADAPTERS:
        assert texts[spec.name] and texts[spec.name] != texts[f"base:{spec.name}"], texts
    assert len({texts[a.name] for a in DEMO_ADAPTERS}) == len(DEMO_ADAPTERS), texts
    # rolling back to v1 changes the answer, to another answer: an empty reply would look like a fault
    assert texts["shouty@1"] and texts["shouty@1"] != texts["shouty"], texts


def test_the_base_answers_in_sentences_and_each_adapter_in_its_style(demo):
    texts = demo["texts"]
    for spec in DEMO_ADAPTERS:
        words = texts[f"base:{spec.name}"].split()
        assert len(words) >= 8 and sum(w.isalpha() for w in words) / len(words) > 0.6, texts
    letters = [c for c in texts["shouty"] if c.isalpha()]
    assert sum(c.isupper() for c in letters) / len(letters) > 0.8, texts["shouty"]
    assert texts["lister"].startswith("- "), texts["lister"]
    question = SMOLLM2.questions["echo"].rstrip("?")
    assert texts["echo"].lower().startswith(" ".join(question.lower().split()[:2])), texts["echo"]


def test_it_imports_registers_and_uploads_real_versions(demo_db):
    from adapters.models import Adapter, BaseModel
    from adapters.storage import blob_sha256

    assert "imported already" in demo_db["log"]  # the session's cached import was reused
    base = BaseModel.objects.get(slug=SMOLLM2.slug)
    assert base.checkpoint_path == str(demo_db["checkpoint"]) and base.architecture == "llama"
    owned = {(a.tenant.slug, a.name): a for a in Adapter.objects.select_related("tenant")}
    assert set(owned) == {("acme", "shouty"), ("acme", "lister"), ("globex", "echo")}
    shouty = owned[("acme", "shouty")]
    versions = list(shouty.versions.order_by("number"))
    assert [v.number for v in versions] == [1, 2]
    assert versions[0].sha256 != versions[1].sha256  # v1 and v2 are different weights: rollback shows it
    assert shouty.active_version == versions[1]
    for adapter in owned.values():
        v = adapter.active_version
        assert blob_sha256(v.storage_key) == v.sha256
        assert (v.rank, sorted(v.target_modules)) == (8, ["k_proj", "o_proj", "q_proj", "v_proj"])


def test_it_writes_logins_keys_and_the_banner_questions_to_a_private_file(demo_db):
    from django.contrib.auth import authenticate

    from gateway.keys import authenticate_api_key
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
    assert state["base"]["slug"] == SMOLLM2.slug and state["base"]["kind"] == "smollm2"
    assert state["questions"] == SMOLLM2.questions
    assert Path(state["finetune_dataset"]).is_file()  # the banner's fine-tuning snippet uploads it


def test_running_it_again_changes_nothing(demo_db):
    """Idempotent: no import, no training, no new versions, the same keys."""
    from adapters.models import AdapterVersion

    before = json.loads((demo_db["dir"] / "keys.json").read_text())
    versions = set(AdapterVersion.objects.values_list("sha256", flat=True))
    with demo_settings(demo_db["root"]):
        log = run_demo_setup("--base", "smollm2", "--models-dir", str(demo_db["checkpoint"].parent),
                             "--dir", str(demo_db["dir"]))
    assert "imported already" in log and log.count("trained already") == 3 and "steps in" not in log, log
    assert set(AdapterVersion.objects.values_list("sha256", flat=True)) == versions
    assert json.loads((demo_db["dir"] / "keys.json").read_text()) == before
