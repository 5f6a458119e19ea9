"""Chat templates that write the BOS token themselves (Llama-3's: ``{{ bos_token }}<|start_header_id|>…``),
on a tokenizer that also adds BOS when asked to add special tokens (Llama-3's does): the prompt the model
reads must begin with *one* BOS, as transformers' ``apply_chat_template(tokenize=True)`` gives, and the
usage must count the tokens the model read.

The request goes through the real API down to the queue; the scripted dispatcher hands the published job
to lorafleet's engine on a tiny checkpoint carrying such a tokenizer, so the usage is the worker's own.
"""
from __future__ import annotations

import pytest

from adapters.manifest import shape_manifest_from_checkpoint
from adapters.models import BaseModel
from demo.tiny_base import build_tiny_base

pytestmark = pytest.mark.django_db

BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"
HEADER = ("<|start_header_id|>", "<|end_header_id|>")
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "you are brief"}, {"role": "user", "content": "what is the sky"}]


def llama3_style_tokenizer():
    """A word-level tokenizer whose post-processor prepends BOS, with a template that writes BOS too."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = "you are brief what is the sky blue system user assistant a it".split()
    specials = ["<pad>", BOS, EOT, *HEADER]
    vocab = {t: i for i, t in enumerate(specials + words + ["<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, vocab[BOS])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOT, pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=list(HEADER))
    fast.chat_template = LLAMA3_TEMPLATE
    return fast


def transformers_chat_ids(tokenizer) -> list[int]:
    """What transformers feeds the model for MESSAGES (v5 returns a BatchEncoding, v4 a list)."""
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def llama3_checkpoint(tmp_path_factory):
    folder = build_tiny_base(tmp_path_factory.mktemp("llama3_bos"), arch="llama", seed=9, max_position=128)
    for stale in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / stale).unlink(missing_ok=True)
    llama3_style_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def engine_dispatcher(api, llama3_checkpoint):
    """The API's base now carries the Llama-3-style tokenizer, and jobs are answered by the real engine."""
    from adapters.storage import read_blob
    from inference_worker.engine import Engine
    from inference_worker.model import ModelRunner

    BaseModel.objects.filter(pk=api.base.pk).update(
        checkpoint_path=str(llama3_checkpoint), shape_manifest=shape_manifest_from_checkpoint(llama3_checkpoint))
    engine = Engine(ModelRunner(llama3_checkpoint, memory_bytes=64 << 20, enable_lora=False), read_blob).start()
    seen = []

    def answer(job, meta):
        seen.append(job)
        result = engine.submit(job).result(timeout=120)
        return [{"type": "final", "result": result.to_dict(), "worker_id": "w1", "attempts": 1}]

    api.dispatcher.answer = answer
    yield seen
    engine.stop()


def test_the_tokenizer_really_adds_bos_on_its_own(llama3_checkpoint):
    """The premise: encode() with special tokens adds BOS, and the rendered template starts with one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama3_checkpoint))
    bos = tokenizer.convert_tokens_to_ids(BOS)
    assert tokenizer.encode("what is the sky", add_special_tokens=True)[0] == bos
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith(BOS) and rendered.count(BOS) == 1
    ids = transformers_chat_ids(tokenizer)
    assert ids.count(bos) == 1 and ids[0] == bos


def test_a_template_that_writes_bos_gets_one_bos_and_usage_counts_what_transformers_counts(
        api, post, engine_dispatcher, llama3_checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama3_checkpoint))
    expected = transformers_chat_ids(tokenizer)

    r = post("/v1/chat/completions", {"model": "base/tiny", "messages": MESSAGES, "max_tokens": 2,
                                      "temperature": 0}, key=api.acme_secret)
    assert r.status_code == 200, r.content
    job = engine_dispatcher[0]
    served = list(job.prompt_token_ids) if job.prompt_token_ids is not None else \
        tokenizer.encode(job.prompt, add_special_tokens=True)  # what the worker reads
    assert served == expected
    assert r.json()["usage"]["prompt_tokens"] == len(expected)
