"""What a worker is asked to do and what it answers: plain dataclasses that travel over Celery as JSON.

The contract between the gateway and the worker, in one place: the gateway builds a GenerationJob and its
JobMeta (gateway/serving.py) and reads the GenerationResult; the worker's task reads both (from_dict) and
answers (inference_worker/tasks.py). The job carries everything the worker needs (DESIGN.md: the worker
never touches the database on the hot path): which weights, by content hash and storage key, and the
sampling parameters. Unknown keys are ignored when reading, so older workers accept newer messages.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import ErrorCode
from .lora_layout import peft_scale

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

D = TypeVar("D", bound="DataclassInstance")


def _from_dict(cls: type[D], d: dict[str, Any]) -> D:
    """Build a dataclass from a dict, ignoring unknown keys so older workers accept newer messages."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


def adapter_identity(weights_sha256: str, rank: int, alpha: float, use_rslora: bool, target_modules) -> str:
    """sha256 over the canonical JSON of the weights' hash and the config fields that change the math."""
    canonical = json.dumps({"weights_sha256": weights_sha256.lower(), "rank": int(rank), "alpha": float(alpha),
                            "use_rslora": bool(use_rslora), "target_modules": sorted(set(target_modules))},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass
class AdapterRef:
    """An immutable adapter version as the worker sees it: identified by the sha256 of its weights."""

    version_id: int
    sha256: str
    storage_key: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: list[str]
    name: str = ""

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) for rsLoRA."""
        return peft_scale(self.alpha, self.rank, self.use_rslora)

    @property
    def identity(self) -> str:
        """What the served math depends on: the weights' sha256 *and* the config that scales and places
        them. Two versions with the same bytes and another lora_alpha (or rsLoRA, or targets) are two
        identities, so the worker's caches never serve one with the other's scale."""
        return adapter_identity(self.sha256, self.rank, self.alpha, self.use_rslora, self.target_modules)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdapterRef:
        ref = _from_dict(cls, d)
        ref.target_modules = list(ref.target_modules)
        return ref


@dataclass
class GenerationJob:
    """One completion request. `adapter=None` means the base model, named explicitly by the caller."""

    request_id: str
    adapter: AdapterRef | None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    tenant: str = ""  # an opaque tenant id: the engine shares the worker fairly between tenants (VTC)
    n: int = 1  # choices: the prompt is prefilled once, its KV blocks shared by the n sequences
    logprobs: int | None = None  # None: none; k: each generated token's logprob and its k most likely rivals
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (completions with echo)
    presence_penalty: float = 0.0  # OpenAI's definitions, on generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM/HF's, on prompt and generated tokens; 1 = off
    logit_bias: list[list] = field(default_factory=list)  # [[token_id, bias], ...]
    # The tenant's share weight (Tenant.share_weight, admin): when tenants compete for the worker's running
    # sequences and KV blocks, each is entitled to weight / (sum of the competing tenants' weights) of them.
    tenant_weight: float = 1.0
    # Scopes the prefix cache further than (tenant, adapter): requests with different salts never share cached
    # KV blocks (vLLM's `cache_salt`; e.g. one salt per end user of a tenant).
    cache_salt: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # asdict recurses: the adapter becomes AdapterRef.to_dict()'s dict

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationJob:
        job = _from_dict(cls, d)
        if isinstance(job.adapter, dict):
            job.adapter = AdapterRef.from_dict(job.adapter)
        job.stop = list(job.stop or [])
        job.stop_token_ids = list(job.stop_token_ids or [])
        if job.prompt_token_ids is not None:
            job.prompt_token_ids = list(job.prompt_token_ids)
        return job


@dataclass
class JobMeta:
    """What travels beside the job: how its caller waits and what the worker checks before running it.

    Built by the gateway (gateway/serving.py), read by the worker's task (inference_worker/tasks.py).
    """

    deadline: float | None = None  # time.time() after which the caller no longer waits; None: a minute from now
    stream: bool = False  # push text deltas as they come, not only the final result
    base_slug: str = ""  # the base the job was routed for (logs, errors)
    base_sha256: str = ""  # a worker serving another checkpoint answers base_mismatch instead of running it
    max_attempts: int = 3  # deliveries after which the job is answered worker_lost, not run again

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> JobMeta:
        meta = _from_dict(cls, d or {})
        meta.deadline = float(meta.deadline) if meta.deadline else None
        meta.stream, meta.max_attempts = bool(meta.stream), int(meta.max_attempts)
        return meta


@dataclass
class Choice:
    """One of a result's n choices. `logprobs`: per generated token {"token": id, "logprob": lp,
    "top": [[id, lp], ...]} (the log-softmax of the model's logits before any sampling parameter), or None."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Choice:
        return _from_dict(cls, d)


@dataclass
class GenerationResult:
    """The answer to one job: tokens and text, or an error code, plus what auditing needs."""

    request_id: str
    status: str  # "ok" | "error"
    error_code: ErrorCode | None = None  # travels as the enum's value (a string); see __post_init__
    error_message: str | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | None (error)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    adapter_sha256: str | None = None  # the hash of the weights the cache verified and served
    adapter_identity: str | None = None  # AdapterRef.identity of what was served (weights + config)
    # How the worker held the served adapter's weights as it applied them: "float32", or "float16" / "bfloat16"
    # from a 16-bit adapter pool (run_worker --adapter-dtype) or a 16-bit model. None for base-model requests.
    adapter_dtype: str | None = None
    queued_s: float = 0.0  # submit -> admitted into the running batch
    first_token_s: float | None = None  # submit -> first generated token
    total_s: float = 0.0  # submit -> done
    # Every choice (text, token_ids and finish_reason above are choice 0's; completion_tokens counts all).
    # Empty from workers that predate n: then choice 0 is the fields above (see all_choices).
    choices: list[Choice] = field(default_factory=list)
    prompt_logprobs: list[dict] | None = None  # per prompt token, as in Choice.logprobs; the first's logprob is None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (usage.prompt_tokens_details)
    preemptions: int = 0  # times a sequence of this request was preempted and recomputed (answer unchanged)

    def __post_init__(self) -> None:
        # A code given or read as a string becomes its ErrorCode; one this side does not know (a newer
        # worker) is an internal_error whose message keeps the code it arrived with.
        if self.error_code is not None and not isinstance(self.error_code, ErrorCode):
            known = ErrorCode.parse(self.error_code)
            if known.value != self.error_code:
                self.error_message = f"{self.error_message or 'error'} (worker error code {str(self.error_code)[:50]!r})"
            self.error_code = known

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def all_choices(self) -> list[Choice]:
        return self.choices or [Choice(0, self.text, list(self.token_ids), self.finish_reason)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationResult:
        res = _from_dict(cls, d)
        res.token_ids = list(res.token_ids)
        res.choices = [c if isinstance(c, Choice) else Choice.from_dict(c) for c in res.choices or []]
        return res
