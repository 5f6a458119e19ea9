"""Helpers for the tests that run `manage.py demo_setup`: run it once per module against the test
database and temporary storage, ask the serving engine what the demo's base and adapters answer, and
ask transformers/PEFT the same (the oracle)."""
from __future__ import annotations

import uuid
from contextlib import contextmanager
from pathlib import Path

from django.core.management import call_command


class Sink:
    """A stdout for call_command that keeps what was written."""

    def __init__(self, lines: list[str] | None = None):
        self.lines = [] if lines is None else lines

    def write(self, s: str) -> None:
        self.lines.append(s)

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        return "".join(self.lines)


def storages(root: Path) -> dict:
    return {
        "default": {"BACKEND": "django.core.files.storage.FileSystemStorage",
                    "OPTIONS": {"location": str(root / "media")}},
        "adapters": {"BACKEND": "adapters.storage.AtomicFileSystemStorage",
                     "OPTIONS": {"location": str(root / "storage")}},
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }


@contextmanager
def demo_settings(root: Path):
    """Temporary storage, and the suite's fast password hasher: the autouse fixture makes tests hash with
    MD5, and a module-scoped run must hash the same way or the tests' authenticate() cannot read it."""
    from django.test import override_settings

    with override_settings(STORAGES=storages(root),
                           PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"]):
        yield


def run_demo_setup(*args: str) -> str:
    out = Sink()
    call_command("demo_setup", *args, "--no-progress", stdout=out)
    return out.text


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


def adapter_ref(version):
    """The worker's view of an AdapterVersion, as the gateway would put it in a job."""
    from protocol.jobs import AdapterRef

    return AdapterRef(version_id=version.pk, sha256=version.sha256, storage_key=version.storage_key,
                      rank=version.rank, alpha=version.alpha, use_rslora=version.use_rslora,
                      target_modules=list(version.target_modules), name=version.adapter.name)


def live_adapters(base_slug: str) -> dict:
    """{adapter name: (AdapterRef of its live version, that version)} for the adapters on `base_slug`."""
    from adapters.models import Adapter

    return {a.name: (adapter_ref(a.active_version), a.active_version)
            for a in Adapter.objects.select_related("active_version__adapter").filter(base__slug=base_slug)}


def engine_answers(base_dir: Path, asks: dict[str, tuple[object, str]], *, max_tokens: int,
                   ignore_eos: bool = False, chat: bool = True) -> dict[str, list[int]]:
    """{label: generated token ids} from lorafleet's engine, all asks in one mixed batch as served.

    `asks` maps a label to (AdapterRef or None for the base, question or raw prompt)."""
    from adapters.storage import read_blob
    from inference_worker.engine import Engine
    from inference_worker.model import ModelRunner
    from protocol.jobs import GenerationJob

    runner = ModelRunner(base_dir, memory_bytes=1 << 30, max_lora_rank=16)  # one pool: KV blocks + adapters
    jobs = {label: GenerationJob(request_id=uuid.uuid4().hex, adapter=ref, max_tokens=max_tokens, temperature=0.0,
                                 prompt=chat_prompt(runner.tokenizer, text) if chat else text, ignore_eos=ignore_eos)
            for label, (ref, text) in asks.items()}
    engine = Engine(runner, read_blob).start()
    try:
        handles = {label: engine.submit(job) for label, job in jobs.items()}
        results = {label: h.result(timeout=300) for label, h in handles.items()}
    finally:
        engine.stop()
    for label, r in results.items():
        assert r.ok, f"{label}: {r.error_code} {r.error_message}"
    return {label: list(r.token_ids) for label, r in results.items()}


def transformers_answers(base_dir: Path, asks: dict[str, tuple[Path | None, str]], *,
                         max_tokens: int) -> dict[str, list[int]]:
    """{label: generated token ids} from transformers (base) and PEFT (adapter folder), greedy."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    out = {}
    for label, (folder, question) in asks.items():
        model = PeftModel.from_pretrained(base, str(folder)).eval() if folder is not None else base
        # Tokenized as the worker does: the rendered template, then encode() with its special-token rule.
        ids = torch.tensor([tokenizer.encode(chat_prompt(tokenizer, question), add_special_tokens=True)])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False)
        out[label] = gen[0, ids.shape[1]:].tolist()  # the stop token included, as the engine reports it
        if folder is not None:
            base = model.unload()
    return out


def delete_demo_rows() -> None:
    """A module fixture runs outside a test transaction: leave the test database as it found it."""
    from django.contrib.auth import get_user_model

    from adapters.models import Adapter, AdapterVersion, BaseModel, VersionPointerChange
    from finetune.models import AdapterProvenance, FineTuningJob, TrainingFile
    from gateway.models import ApiKey
    from tenants.models import Membership, Tenant

    ApiKey.objects.all().delete()
    AdapterProvenance.objects.all().delete()
    FineTuningJob.objects.all().delete()  # and their events
    TrainingFile.objects.all().delete()
    VersionPointerChange.objects.all().delete()
    Adapter.objects.update(active_version=None)
    AdapterVersion.objects.all().delete()
    Adapter.objects.all().delete()
    Membership.objects.all().delete()
    Tenant.objects.all().delete()
    BaseModel.objects.all().delete()
    get_user_model().objects.all().delete()
