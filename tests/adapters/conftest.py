"""Upload fixtures: a tiny base built locally, adapters written by PEFT itself, storage under tmp_path.

Adapters are built once per session (about a second each): the good one with the project's factory,
the hostile or malformed ones with PEFT on purpose-built models, so each file is exactly what a
customer's `save_pretrained` would produce.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from demo.tiny_base import build_tiny_base
from tests.support.peft_factory import make_random_peft_adapter

BASE_MAX_RANK = 16


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory) -> Path:
    # hidden 64, 4 heads of 16, 2 KV heads: q_proj 64→64, v_proj 64→32, 2 layers.
    return build_tiny_base(tmp_path_factory.mktemp("upload_base"), arch="llama", seed=0)


def peft_save(model, out_dir: Path, *, seed: int = 0, mutate: Callable | None = None,
              task_type: str | None = "CAUSAL_LM", **lora_kwargs) -> Path:
    """get_peft_model(...).save_pretrained with random non-zero lora weights; `mutate` edits before saving."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(lora_dropout=0.0, bias="none", task_type=task_type, **lora_kwargs)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
        if mutate is not None:
            mutate(peft_model)
    peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)


def _load_base(base_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)


def _set_nan(peft_model) -> None:
    for name, param in peft_model.named_parameters():
        if name.endswith("layers.1.self_attn.v_proj.lora_B.default.weight"):
            param[3, 5] = float("nan")
            return
    raise AssertionError("v_proj lora_B of layer 1 not found")


@pytest.fixture(scope="session")
def peft_adapters(tiny_base_dir, tmp_path_factory) -> SimpleNamespace:
    """Folders of adapter_config.json + adapter_model.safetensors, good and bad."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    root = tmp_path_factory.mktemp("peft")
    good = make_random_peft_adapter(tiny_base_dir, root / "good", r=8, alpha=16, seed=1)
    good_other = make_random_peft_adapter(tiny_base_dir, root / "good_other", r=4, alpha=8, seed=2,
                                          target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                          "gate_proj", "up_proj", "down_proj"),
                                          use_rslora=True, dtype=torch.bfloat16)
    rank_over_cap = make_random_peft_adapter(tiny_base_dir, root / "rank32", r=2 * BASE_MAX_RANK, seed=3)
    modules_to_save = peft_save(_load_base(tiny_base_dir), root / "mts", r=8, lora_alpha=16,
                                target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    nan = peft_save(_load_base(tiny_base_dir), root / "nan", r=8, lora_alpha=16,
                    target_modules=["q_proj", "v_proj"], mutate=_set_nan)
    # Same layer count and hidden size but 4 KV heads instead of 2: v_proj is 64→64, not 64→32.
    other_shape = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=4, intermediate_size=128, vocab_size=512)
    wrong_shapes = peft_save(LlamaForCausalLM(other_shape), root / "wrong_shapes", r=8, lora_alpha=16,
                             target_modules=["q_proj", "v_proj"])
    # Trained on the bare decoder (no LM head): every name lacks the "model." segment, so no tensor
    # lands on a module of our base — served as is, it would be the base model under a new name.
    no_match = peft_save(LlamaModel(other_shape), root / "no_match", r=8, lora_alpha=16,
                         target_modules=["q_proj", "v_proj"], task_type=None)
    return SimpleNamespace(good=good, good_other=good_other, rank_over_cap=rank_over_cap,
                           modules_to_save=modules_to_save, nan=nan, wrong_shapes=wrong_shapes,
                           no_match=no_match)


@pytest.fixture
def blob_dir(adapter_storage_dir) -> Path:
    """The "adapters" storage, pointed at an empty folder of this test."""
    adapter_storage_dir.mkdir()
    return adapter_storage_dir


@pytest.fixture
def base(db, tiny_base_dir):
    from adapters.services import register_base_model

    return register_base_model("tiny", tiny_base_dir, max_lora_rank=BASE_MAX_RANK)


@pytest.fixture
def alice(db):
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_user("alice", password="alice-password-1")


@pytest.fixture
def adapter(base, alice):
    from adapters.services import create_adapter
    from tenants.services import create_tenant

    acme = create_tenant("acme", "Acme", owner=alice)
    return create_adapter(acme, "support-bot", base, created_by=alice)


@pytest.fixture
def upload(blob_dir):
    """upload(adapter, folder, **kwargs): create_adapter_version from the two files of a PEFT folder."""
    from adapters.uploads import create_adapter_version

    def _upload(adapter, folder: Path, *, weights_name: str = "adapter_model.safetensors", **kwargs):
        with open(folder / "adapter_config.json", "rb") as cfg, open(folder / weights_name, "rb") as weights:
            return create_adapter_version(adapter, config_file=cfg, weights_file=weights, **kwargs)

    return _upload
