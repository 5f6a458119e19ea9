"""Makes real PEFT LoRA adapters for a local base, with random non-zero weights.

Built with PEFT itself (`get_peft_model(...).save_pretrained`) so the files are exactly what a
customer uploads. PEFT initialises lora_B to zero, which would make every adapter an identity and
every "adapter changes the output" test vacuous, so both A and B are re-drawn at random.
Django-free: tests and benches use it (`from tests.support.peft_factory import ...`).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def make_random_peft_adapter(base_dir, out_dir, *, r: int = 8, alpha: float = 16,
                             target_modules: Sequence[str] = ("q_proj", "v_proj"),
                             use_rslora: bool = False, seed: int = 0,
                             dtype: torch.dtype = torch.float32) -> Path:
    """Write adapter_config.json + adapter_model.safetensors to out_dir and return its path."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        use_rslora=use_rslora, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                # std 1/sqrt(fan_in) for both factors: the LoRA delta is then comparable to the base
                # projection's output, large enough to flip greedy tokens.
                fan_in = param.shape[1]
                param.copy_(torch.randn(param.shape, generator=gen) / fan_in ** 0.5)
    model = model.to(dtype)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out
