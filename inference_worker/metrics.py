"""Engine counters without a Prometheus dependency: the worker's exporter reads `snapshot()`.

Sums are kept next to counts (batch-size sum and step count, ...) so an exporter can turn them into
rates and means over any window; the engine thread is the only writer.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineMetrics:
    steps: int = 0
    batch_size_sum: int = 0  # sequences per forward pass, summed over steps
    batch_size_last: int = 0
    batch_size_max: int = 0
    step_tokens_sum: int = 0  # tokens (prefill + decode) per forward pass, summed
    distinct_adapters_sum: int = 0  # distinct LoRA slots (base counted as one) per forward pass, summed
    distinct_adapters_last: int = 0
    distinct_adapters_max: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    requests_submitted: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    admissions_waited_memory: int = 0  # requests that waited at admission for KV or adapter pages
    # n > 1: a request's prompt is prefilled once for its n sequences. prompt_prefills counts prompts that
    # finished prefilling (one per request), sequences the sequences admitted (n per request), prefill_tokens
    # the prompt tokens run through the model (each prompt once, whatever n).
    prompt_prefills: int = 0
    sequences: int = 0
    prefill_tokens: int = 0
    kv_blocks_shared: int = 0  # block-table entries that point at another sequence's prompt block (not copied)
    kv_blocks_copied: int = 0  # partial last prompt blocks copied at a fork (copy-on-write)
    # scheduling by share (engine.py): preemptions (every one, and those made for a tenant within its share),
    # the tokens re-read after them, and the prefix cache's prompt tokens looked up and found
    preemptions: int = 0
    preemptions_for_share: int = 0
    recomputed_tokens: int = 0
    decode_rows_deferred: int = 0  # decode rows of a tenant above its share left out of a step (step-time bound)
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    forward_seconds: float = 0.0
    step_seconds: float = 0.0

    def record_step(self, batch_size: int, tokens: int, distinct_adapters: int, forward_s: float, step_s: float) -> None:
        self.steps += 1
        self.batch_size_sum += batch_size
        self.batch_size_last = batch_size
        self.batch_size_max = max(self.batch_size_max, batch_size)
        self.step_tokens_sum += tokens
        self.distinct_adapters_sum += distinct_adapters
        self.distinct_adapters_last = distinct_adapters
        self.distinct_adapters_max = max(self.distinct_adapters_max, distinct_adapters)
        self.forward_seconds += forward_s
        self.step_seconds += step_s

    def snapshot(self) -> dict:
        d = asdict(self)
        d["batch_size_mean"] = self.batch_size_sum / self.steps if self.steps else 0.0
        d["distinct_adapters_mean"] = self.distinct_adapters_sum / self.steps if self.steps else 0.0
        q = self.prefix_cache_query_tokens
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_tokens / q if q else 0.0
        return d
