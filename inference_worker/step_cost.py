"""What a forward step costs, measured on this worker, and how much prefill a step may carry.

A step's time is close to linear in four things (on a CPU and on a GPU alike): a fixed part (reading the
weights once, launching the kernels), the tokens it runs through the linear layers, the attention it computes —
a prefill chunk of n tokens after `start` cached ones attends over n * (start + (n + 1) / 2) positions, a decode
row over its context — and the cached positions it reads: every row or chunk after cached ones reads its
sequence's K/V pages once (start + n positions), whatever its length. That last term is what a few tokens deep in
a long prompt mostly cost: on SmolLM2 at position 6,000 one more query row costs about a third of what reading
the pages for it costs. `StepCost` fits

    seconds ≈ fixed + per_token * tokens + per_attended * attended + per_read * read

to the steps the engine runs (least squares, old steps forgotten geometrically, so the fit follows the host's
phases), starting from a prior that is only used until the worker has measured enough steps.

The engine uses it to bound prefill (issue 46): when a step carries other tenants' decodes, its prefill tokens
are cut so that the step takes at most `factor` times what it would take without them — a near-context prompt
is read a little every step instead of stalling every other tenant's next token for a whole chunk. The bound
is never below one token, so a long prompt always finishes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def attended(start: int, n: int) -> float:
    """Positions attended by a chunk of n tokens after `start` cached ones (a decode row: n = 1)."""
    return n * (start + (n + 1) / 2)


def read(start: int, n: int) -> int:
    """Cached positions whose K/V a chunk of n tokens after `start` cached ones reads from the pages (once for the
    whole chunk; a whole prompt, start 0, attends to the keys it computed itself)."""
    return start + n if start else 0


@dataclass
class StepShape:
    tokens: int = 0
    attended: float = 0.0
    read: int = 0

    def add(self, start: int, n: int) -> None:
        self.tokens += n
        self.attended += attended(start, n)
        self.read += read(start, n)

    def features(self) -> np.ndarray:
        return np.array([1.0, self.tokens, self.attended, self.read], dtype=np.float64)


class StepCost:
    """Online fit of step seconds; `fixed=(a, b, c[, d])` freezes it (deterministic tests, benchmarks).

    Exponentially weighted least squares (old steps forgotten by `forget` a step) with a ridge toward the last
    estimate: the weighted sums stay bounded however long the worker runs, and a direction the steps stop varying
    in keeps what was learned of it. The prior (a CPU's costs for a model of ~100M parameters) errs on the slow
    side, which only makes prefill chunks smaller until the first steps are measured."""

    def __init__(self, fixed: tuple[float, ...] | None = None, *, prior: tuple[float, ...] =
                 (5e-3, 1e-3, 1e-6, 2e-6), forget: float = 0.98, ridge: float = 0.01):
        self.frozen = fixed is not None
        given = tuple(fixed if fixed is not None else prior)
        self.prior = np.array(given + (0.0,) * (4 - len(given)), dtype=np.float64)
        self.theta = self.prior.copy()
        # feature scales keep the normal equations well conditioned (tokens ~1e2, attended ~1e5, read ~1e4)
        self._scale = np.array([1.0, 1e-2, 1e-5, 1e-4])
        self._xx = np.zeros((4, 4))
        self._xy = np.zeros(4)
        self.forget, self.ridge = forget, ridge
        self.samples = 0

    def predict(self, shape: StepShape) -> float:
        return float(self.theta @ shape.features())

    def observe(self, shape: StepShape, seconds: float) -> None:
        if self.frozen or not math.isfinite(seconds) or seconds <= 0:
            return
        x = shape.features() * self._scale
        self._xx = self.forget * self._xx + np.outer(x, x)
        self._xy = self.forget * self._xy + x * seconds
        self.samples += 1
        # the ridge pulls toward the last estimate, not the prior: a direction the recent steps do not vary in (a
        # run of decodes after a long prompt) keeps what was learned of it instead of drifting back
        prior = self.theta / self._scale
        try:
            w = np.linalg.solve(self._xx + self.ridge * np.eye(4), self._xy + self.ridge * prior)
        except np.linalg.LinAlgError:
            return
        if not np.all(np.isfinite(w)):
            return
        # a cost is never negative, nor the fixed part zero: a noisy phase must not make prefill look free
        w = np.maximum(w, [1e-5, 0.0, 0.0, 0.0])
        self.theta = w * self._scale

    def added_seconds(self, start: int, n: int) -> float:
        """Seconds a chunk of n tokens after `start` cached ones adds to a step."""
        _, b, c, d = self.theta
        return float(b * n + c * attended(start, n) + d * read(start, n))

    def prefill_bound(self, start: int, limit: int, allowance: float, floor: int = 1) -> int:
        """The most tokens (floor..limit) of a chunk after `start` cached tokens that add at most `allowance`
        seconds to a step."""
        if limit <= 0:
            return 0
        if limit <= floor or self.added_seconds(start, limit) <= allowance:
            return limit
        lo, hi = floor, limit  # the answer is the largest n in lo..hi with extra(n) <= allowance, or lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.added_seconds(start, mid) <= allowance:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def snapshot(self) -> dict:
        a, b, c, d = (float(v) for v in self.theta)
        return {"fixed_s": a, "per_token_s": b, "per_attended_s": c, "per_read_s": d, "samples": self.samples}
