"""The bases users bring, through the whole stack (issue 48): per family, a tiny random checkpoint with the family's
features switched on is registered and served by a real worker process of its own; a customer logs in, creates an
adapter on it and uploads a PEFT folder saved on the family's own module names (Phi-3's fused qkv_proj and
gate_up_proj, not renamed) through the dashboard's upload endpoint; a chat with it through the official openai client
answers with the tokens transformers + PEFT's greedy generate gives for the same rendered prompt (not those of the
base alone), and the audit row names the adapter, the version and the weights served.

A family is one FAMILIES entry: demo.tiny_base's arch (demo.tiny_gemma's for Gemma 2 and 3), its shape, the
config.json changes that switch its features on, and the PEFT target modules in its own names.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

import httpx
import openai
import pytest
import torch

from demo.tiny_base import build_tiny_base
from demo.tiny_gemma import GEMMA_ARCHITECTURES, build_tiny_gemma
from protocol.jobs import adapter_identity
from tests.support.peft_factory import make_random_peft_adapter

pytestmark = pytest.mark.timeout(900)  # a checkpoint, a PEFT folder and a worker start per family, on 2 shared cores

ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _longrope(half: int) -> dict:
    """Phi-3's LongRoPE: per-frequency factors, short within original_max_position_embeddings, long past it."""
    gen = torch.Generator().manual_seed(7)
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1.0 + 0.5 * torch.rand(half, generator=gen)).tolist(),
            "long_factor": (1.0 + 8.0 * torch.rand(half, generator=gen)).tolist()}


@dataclass(frozen=True)
class Family:
    arch: str  # demo.tiny_base's arch, or demo.tiny_gemma's ("gemma2", "gemma3")
    shape: dict  # build_tiny_base's (build_tiny_gemma's) shape and feature arguments
    targets: tuple[str, ...]  # PEFT target_modules, in the family's own names
    config: dict = field(default_factory=dict)  # config.json changes: the family's features switched on


FAMILIES = [
    # per-head q/k RMSNorm, head_dim 24 beside hidden 64 (q_proj 64 -> 96), GQA, sliding-window layers 1 and 2 (8)
    pytest.param(Family("qwen3", dict(hidden=64, heads=4, kv_heads=2, head_dim=24, layers=3, intermediate=96),
                        ALL_SEVEN, dict(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                        layer_types=None)), id="qwen3"),
    # fused qkv_proj and gate_up_proj (checkpoint and adapter), GQA, every layer windowed (8), LongRoPE (head_dim 16:
    # 8 factors each, the attention factor of 512 over 128 positions); the chat (85 tokens) stays within the original
    # 128 positions, where transformers' whole-prompt forward and a cache agree (tests/engine/test_model_families.py
    # follows LongRoPE across it token by token)
    pytest.param(Family("phi3", dict(hidden=64, heads=4, kv_heads=2, layers=2, intermediate=96),
                        ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
                        dict(sliding_window=8, rope_parameters=_longrope(8), original_max_position_embeddings=128,
                             max_position_embeddings=512)), id="phi3"),
    # Gemma 2: attention logit soft-capping (4) and final logit soft-capping (6), small enough to bite; layers 0 and 2
    # sliding (window 6) beside global 1 and 3; query_pre_attn_scalar 20 beside head_dim 24 (q_proj 64 -> 96); GeGLU;
    # (1 + w) pre- and post-norms; the head tied to the embedding table as real Gemmas have it
    pytest.param(Family("gemma2", dict(hidden=64, heads=4, kv_heads=2, head_dim=24, layers=4, intermediate=96,
                                       sliding_window=6, attn_softcap=4.0, final_softcap=6.0,
                                       tie_embeddings=True), ALL_SEVEN), id="gemma2"),
    # Gemma 3 (model_type gemma3_text): q/k norms, layers 0, 1 and 3 sliding (window 6) rotating with the local base
    # (10,000), the global layer 2 with the global base (1,000,000) and linear scaling x4; final soft-capping (6;
    # Gemma 3 applies no attention soft-capping, as transformers does not); tied head
    pytest.param(Family("gemma3", dict(hidden=64, heads=4, kv_heads=2, head_dim=24, layers=4, intermediate=96,
                                       sliding_window=6, attn_softcap=None, final_softcap=6.0,
                                       layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                    "sliding_attention"],
                                       rope_theta=1_000_000.0, local_rope_theta=10_000.0,
                                       rope_scaling={"rope_type": "linear", "factor": 4.0}, tie_embeddings=True),
                        ALL_SEVEN), id="gemma3_text"),
]

MESSAGES = [{"role": "system", "content": "You answer questions about bicycles in one sentence."},
            {"role": "user", "content": "How often should I oil the chain?"}]
MAX_TOKENS = 12


def build_base(family: Family, folder) -> object:
    build = build_tiny_gemma if family.arch in GEMMA_ARCHITECTURES else build_tiny_base
    path = build(folder, arch=family.arch, seed=5, **family.shape)
    if family.config:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(family.config)
        cfg = {k: v for k, v in cfg.items() if v is not None}
        (path / "config.json").write_text(json.dumps(cfg))
    return path


SEED = """
from django.contrib.auth import get_user_model
from adapters.services import register_base_model
from gateway.services import issue_api_key
from tenants.services import create_tenant
base = register_base_model({slug!r}, {checkpoint!r}, queue_name={queue!r})
user = get_user_model().objects.create_user({user!r}, password={password!r})
tenant = create_tenant({slug!r}, "Family " + {slug!r}, owner=user)
_, key = issue_api_key(tenant, "family e2e")
result = {{"base_id": base.pk, "architecture": base.architecture, "key": key}}
"""


def _csrf(client: httpx.Client, path: str) -> str:
    page = client.get(path)
    assert page.status_code == 200, (path, page.status_code)
    return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)


def upload_through_the_dashboard(url: str, user: str, password: str, base_id: int, name: str, folder) -> dict:
    """What a customer does: log in, create the adapter on the base, upload the PEFT folder's two files (the
    upload page's script asks for JSON), making it live."""
    with httpx.Client(base_url=url, timeout=120, follow_redirects=False) as client:
        r = client.post("/login/", data={"username": user, "password": password,
                                         "csrfmiddlewaretoken": _csrf(client, "/login/")}, headers={"Referer": url})
        assert r.status_code == 302, r.text[-2000:]
        r = client.post("/adapters/new/", data={"name": name, "base": base_id,
                                                "csrfmiddlewaretoken": _csrf(client, "/adapters/new/")})
        assert r.status_code == 302, r.text[-2000:]
        upload_path = r.headers["Location"]
        token = _csrf(client, upload_path)
        with open(folder / "adapter_config.json", "rb") as cfg, open(folder / "adapter_model.safetensors", "rb") as w:
            r = client.post(upload_path, data={"activate": "on", "csrfmiddlewaretoken": token},
                            files={"config_file": ("adapter_config.json", cfg, "application/json"),
                                   "weights_file": ("adapter_model.safetensors", w, "application/octet-stream")},
                            headers={"Accept": "application/json", "X-CSRFToken": token, "Referer": url + upload_path})
        assert r.status_code == 201, r.text[-2000:]
        assert r.json()["live"] is True
        return r.json()


def peft_greedy(base_path, adapter_dir, prompt: list[int]) -> tuple[list[int], list[int]]:
    """transformers + PEFT's greedy tokens for the prompt, and the base's alone (generate stops at EOS, as we do)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def generate(model) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False)
        return out[0, len(prompt):].tolist()

    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32).eval()
    alone = generate(base)
    return generate(PeftModel.from_pretrained(base, str(adapter_dir)).eval()), alone


@pytest.mark.parametrize("family", FAMILIES)
def test_a_familys_peft_adapter_uploaded_and_chatted_with_answers_as_peft_does(e2e, db_rows, tmp_path, family):
    from transformers import AutoTokenizer

    slug = f"{family.arch}-{e2e.suffix}-{secrets.token_hex(2)}"
    checkpoint = build_base(family, tmp_path / "base")
    adapter_dir = make_random_peft_adapter(checkpoint, tmp_path / "peft", r=16, alpha=32,
                                           target_modules=family.targets, seed=3)
    saved = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert sorted(saved["target_modules"]) == sorted(family.targets)  # as PEFT saved them: nothing renamed
    password = secrets.token_urlsafe(12)
    seeded = e2e.stack.django(SEED.format(slug=slug, checkpoint=str(checkpoint), queue=f"e2e.{slug}", user=slug,
                                          password=password))
    assert seeded["architecture"] == json.loads((checkpoint / "config.json").read_text())["model_type"]
    worker = e2e.stack.start_worker(slug, name=f"worker-{family.arch}")
    try:
        version = upload_through_the_dashboard(e2e.url, slug, password, seeded["base_id"], "chain-expert",
                                               adapter_dir)
        client = openai.OpenAI(base_url=e2e.url + "/v1", api_key=seeded["key"], max_retries=0, timeout=300)
        answer = client.chat.completions.create(model="chain-expert", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                temperature=0, logprobs=True,
                                                extra_body={"return_tokens_as_token_ids": True})
    finally:
        worker.proc.stop()  # its CPU back to the next family's worker

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    prompt = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                return_dict=False))
    original = family.config.get("original_max_position_embeddings")
    assert original is None or len(prompt) + MAX_TOKENS <= original  # what the FAMILIES comment promises
    theirs, base_alone = peft_greedy(checkpoint, adapter_dir, prompt)
    ours = [int(t.token.removeprefix("token_id:")) for t in answer.choices[0].logprobs.content]
    eos = set(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    if theirs and theirs[-1] in eos:  # generate keeps the EOS it stopped at; the answer ends there ("stop")
        assert answer.choices[0].finish_reason == "stop"
        theirs = theirs[:-1]
        ours = [t for t in ours if t not in eos]
    assert answer.usage.prompt_tokens == len(prompt)
    assert ours == theirs, f"{family.arch}: served {ours}, PEFT {theirs}"
    assert theirs != base_alone[:len(theirs)]  # the adapter changes the answer: equality above is not the base's

    lorafleet = answer.model_extra["lorafleet"]
    rows = db_rows("SELECT status, adapter_name, version_number, weights_sha256, adapter_identity, base_slug "
                   "FROM gateway_auditrecord WHERE request_id::text = %s", (lorafleet["request_id"],))
    assert len(rows) == 1
    row = rows[0]
    identity = adapter_identity(version["sha256"], 16, 32, False, family.targets)
    assert (row["status"], row["adapter_name"], row["version_number"], row["weights_sha256"], row["base_slug"]) == \
        ("ok", "chain-expert", version["number"], version["sha256"], slug)
    assert row["adapter_identity"] == identity == lorafleet["adapter_identity"]
