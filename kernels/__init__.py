"""Batched multi-LoRA kernels (SGMV): the low-rank term of many adapters in one call per projection.

Public surface: `LoraMapping.build`, `add_lora`, `lora_shrink`, `lora_expand`. Imports nothing of the
project. (Hugging Face publishes an unrelated PyPI package also named `kernels`; never install it here.)
"""
from .dispatch import add_lora, lora_expand, lora_shrink
from .mapping import LoraMapping

__all__ = ["LoraMapping", "add_lora", "lora_expand", "lora_shrink"]
