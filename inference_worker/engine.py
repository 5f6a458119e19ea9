"""The engine: one thread that runs continuous (iteration-level) batching over one ModelRunner.

Any thread may `submit(job)`; the engine thread, at every step,
  1. takes new jobs and cancellations from its inbox,
  2. admits waiting work — new requests and preempted sequences — in fair order (below) while sequence slots,
     KV blocks and adapter pages allow, preempting a tenant above its share for a tenant below it,
  3. makes sure every running sequence has the KV blocks its next tokens need, taking them as it grows and
     preempting when the pool runs out,
  4. builds one batch: a prefill chunk for sequences still reading their prompt (or re-reading it after a
     preemption) and one decode token for the others, ordered so that each adapter's tokens are contiguous
     (the segments SGMV consumes), and runs ONE `runner.forward` over all of it,
  5. samples, checks stop conditions, streams text, and retires finished sequences at once, freeing their KV
     blocks and unpinning their adapters.

Memory (one pool for KV blocks and adapters, memory_pool.py): KV is taken on demand. A sequence holds the
blocks it has written plus those its next chunk writes; admission needs the first prefill chunk's blocks, not
prompt + max_tokens. What cannot fit even alone is refused at once: a prompt whose KV exceeds the pool
(`prompt_too_long`), an adapter whose pages plus that prompt's KV exceed it (`adapter_too_large`). A sequence
that outgrows the whole pool while alone in it ends with finish_reason "length".

Preemption (by recompute, as vLLM's default): a preempted sequence gives back its blocks and keeps everything
else — its generated tokens, its sampler (seeded generators carry on where they were), its penalties, logprobs
and streamed text — and waits to be readmitted; it then re-reads prompt + generated tokens (most of it usually
straight from the prefix cache) and samples its next token from the last row. The client sees one unbroken
answer: tokens are never lost, repeated or changed, and usage counts each once. A request whose sequences are
all preempted also gives back its adapter pin while it waits. Victims: the tenant most above its share (usage
divided by weight), its most recently started sequence first. Preempted when:
  - the pool runs out while running sequences grow (cached blocks are evicted first, then idle adapters);
  - another tenant waits that is within its share while this tenant is above its own — for sequence slots
    (`max_running`) or for KV blocks — within the step it waits in.

Tenant shares (work-conserving): a tenant's share of slots and blocks is weight / (sum of the weights of the
tenants with work in the engine); `GenerationJob.tenant_weight` carries Tenant.share_weight. A tenant alone
uses everything; a tenant above its share is only preempted for a waiting tenant within its own, and only as
far as that tenant needs (never below its share), so shares do not thrash.

Order (Sheng et al., "Fairness in Serving LLMs", OSDI 2024): virtual token counters, service received per
tenant (prompt tokens W_PROMPT, generated tokens W_OUTPUT; recomputation after a preemption is not charged).
Admission and the prefill budget go to the tenant with the least service first, each tenant's work in arrival
order; a tenant that becomes active starts at the least service the active have received (no banking).
A request that waits for memory while within its share holds the line (nothing behind it takes the pages it
waits for, so it cannot starve); one above its share steps aside for the others.

Steps bounded by time (step_cost.py): the worker fits a step's seconds to its decode rows, prefill tokens and
attended positions. When a step carries decodes of a tenant other than the one whose prompt it reads, that
prompt's chunk is cut so the step costs at most `prefill_step_factor` times the step without it (never below one
token: a near-context prompt is read a little every step and still finishes). On a CPU a step's time also grows
with its decode rows: while a tenant within its share decodes, the rows of a tenant above its share ride only
within the same bound (oldest first, at least one a step; the others keep their KV and wait the step out).

Prefix cache (prefix_cache.py): every full KV block is keyed by a hash chain over (tenant, adapter identity or
base, cache_salt, token ids); a new or resumed sequence takes the longest run of cached blocks at its start,
never another tenant's or another adapter's. Freed cached blocks stay in the pool until their pages are needed
(LRU, before anything is preempted). `cached_tokens` in the result says how much of the prompt was reused.
Requests asking for prompt logprobs read their whole prompt.

Failures are per request: a bad adapter, an over-long prompt or bad parameters end that request with an
error code; if a forward pass raises, the batch is re-run sequence by sequence to find the culprit.

n > 1 (several choices for one prompt): the prompt is prefilled ONCE, by the first sequence; the others wait
(state FORK) and count in the slots. When the prompt is in, the n sequences fork: each takes a first token from
the same logits (its own sampler, its own derived seed), shares the prompt's full blocks (reference-counted
in the pool, only ever read), and gets its own copy of the partial last block (copy-on-write); from then on
they decode, and are preempted, as n independent rows. `prompt_prefills` / `sequences` / `prefill_tokens` in
stats() count it.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Iterator
from functools import partial
from typing import cast

import torch

from protocol.errors import ErrorCode
from protocol.jobs import Choice, GenerationJob, GenerationResult

from .adapter_cache import FAILED, LOADING, NO_ROOM, AdapterCache
from .kv_cache import blocks_needed
from .metrics import EngineMetrics
from .model import SeqStep
from .openmp import release_thread_team
from .prefix_cache import chain, root_key
from .sampling import IncrementalText, NonFiniteLogits, SamplingParams, SequenceSampling, prompt_logprobs, sample_step
from .step_cost import StepCost, StepShape

log = logging.getLogger(__name__)

class RequestHandle:
    """What `submit` returns: wait for the result, stream deltas, or cancel. Thread-safe."""

    def __init__(self, request_id: str, engine: Engine, n: int = 1, logprobs: bool = False):
        self.request_id = request_id
        self._engine = engine
        self._cond = threading.Condition()
        # Per choice: text that is final (never taken back by a stop string), and the logprob entries of the
        # tokens up to it (a list the engine appends to; `_lp_count` of them are published).
        self._texts = [""] * n
        self._lps: list[list | None] = [[] if logprobs else None for _ in range(n)]
        self._lp_count = [0] * n
        self._prompt_lps: list | None = None
        self._version = 0
        self._result: GenerationResult | None = None

    def result(self, timeout: float | None = None) -> GenerationResult:
        with self._cond:
            if not self._cond.wait_for(lambda: self._result is not None, timeout):
                raise TimeoutError(f"request {self.request_id} not done after {timeout} s")
            return cast(GenerationResult, self._result)

    def done(self) -> bool:
        return self._result is not None

    def cancel(self) -> None:
        """Ends the request at the next step; its result has finish_reason 'cancelled'."""
        self._engine._post(("cancel", self))

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """Yields choice 0's text deltas as they are generated and ends when the request ends (check
        `result()` for how it ended). Text that could still turn out to be the start of a stop string is held
        back."""
        for delta in self.deltas(timeout):
            if delta["index"] == 0 and delta["text"]:
                yield delta["text"]

    def deltas(self, timeout: float | None = None) -> Iterator[dict]:
        """Yields {"index": choice, "text": new text} as it is generated, with "logprobs": [entries of the
        tokens since the last delta of that choice] when the request asked for logprobs, and "prompt_logprobs"
        once (on the first delta) when it asked for those. Ends when the request ends; the deltas then add up
        to each choice's text (for a request that failed: to what had been sent)."""
        n = len(self._texts)
        sent_text, sent_lp, seen = [0] * n, [0] * n, -1
        prompt_sent = False
        while True:
            with self._cond:
                if not self._cond.wait_for(partial(self._changed_since, seen), timeout):
                    raise TimeoutError(f"request {self.request_id}: no token for {timeout} s")
                seen, finished = self._version, self._result is not None
                texts, lps, counts, prompt = list(self._texts), list(self._lps), list(self._lp_count), self._prompt_lps
            for i in range(n):
                lp = lps[i]
                new_lp = lp is not None and counts[i] > sent_lp[i]
                first = prompt is not None and not prompt_sent
                if len(texts[i]) <= sent_text[i] and not new_lp and not first:
                    continue
                delta: dict = {"index": i, "text": texts[i][sent_text[i]:]}
                if lp is not None:
                    delta["logprobs"] = lp[sent_lp[i]:counts[i]]
                    sent_lp[i] = max(sent_lp[i], counts[i])
                if first:
                    delta["prompt_logprobs"], prompt_sent = prompt, True
                sent_text[i] = max(sent_text[i], len(texts[i]))
                yield delta
            if finished:
                return

    def _changed_since(self, version: int) -> bool:
        return self._version != version or self._result is not None

    # engine side
    def _publish(self, index: int, text: str, lps: list | None = None) -> None:
        count = len(lps) if lps is not None else 0
        if len(text) != len(self._texts[index]) or count != self._lp_count[index]:
            with self._cond:
                self._texts[index], self._lps[index], self._lp_count[index] = text, lps, count
                self._version += 1
                self._cond.notify_all()

    def _publish_prompt(self, lps: list) -> None:
        with self._cond:
            self._prompt_lps = lps
            self._version += 1
            self._cond.notify_all()

    def _finish(self, result: GenerationResult) -> None:
        with self._cond:
            if result.status == "ok" or result.finish_reason == "cancelled":
                for c in result.choices[:len(self._texts)]:
                    self._texts[c.index] = c.text
                    if c.logprobs is not None:
                        self._lps[c.index], self._lp_count[c.index] = c.logprobs, len(c.logprobs)
                if result.prompt_logprobs is not None:
                    self._prompt_lps = result.prompt_logprobs
            self._result = result
            self._version += 1
            self._cond.notify_all()



# A sequence's states: WAIT (a new request's first sequence), RUN, FORK (a sibling waiting for the prompt the first
# sequence reads), PREEMPTED (waits to re-read its tokens), DONE.
WAIT, RUN, FORK, PREEMPTED, DONE = "wait", "run", "fork", "preempted", "done"


class _Seq:
    """One of a request's n sequences (choices): its block table (the prompt's full blocks shared with its
    siblings), its tokens, sampling state and text.

    Its tokens are the request's prompt followed by `out_ids`; `num_computed` of them are in the KV cache. A
    running sequence computes tokens[num_computed:] (a prefill chunk at a time, or the one token it sampled
    last) and samples when it has computed all of them."""

    __slots__ = ("req", "index", "blocks", "num_computed", "out_ids", "sampling", "text", "done", "finish_reason",
                 "logprobs", "state", "keys", "started", "recompute_upto")

    def __init__(self, req: _Request, index: int, sampling: SequenceSampling, text: IncrementalText,
                 logprobs: bool):
        self.req = req
        self.index = index
        self.blocks: list[int] = []
        self.num_computed = 0  # tokens of this sequence in the KV cache (its siblings' shared prompt included)
        self.out_ids: list[int] = []
        self.sampling = sampling
        self.text = text
        self.done = False
        self.finish_reason: str | None = None
        self.logprobs: list[dict] | None = [] if logprobs else None
        self.state = WAIT if index == 0 else FORK
        self.keys: list[bytes] = []  # prefix-cache keys of its full computed blocks, in order
        self.started = 0  # when it first started running (engine counter): the most recent is preempted first
        self.recompute_upto = 0  # tokens it had computed when last preempted (re-reading them is recomputation)

    @property
    def length(self) -> int:
        return len(self.req.prompt_ids) + len(self.out_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Its tokens start..end-1 (prompt, then generated)."""
        p = self.req.prompt_ids
        n = len(p)
        if end <= n:
            return p[start:end]
        if start >= n:
            return self.out_ids[start - n:end - n]
        return p[start:] + self.out_ids[:end - n]


class _Request:
    """Engine-private state of one request: its prompt (prefilled once) and its n sequences."""

    __slots__ = (
        "job", "handle", "key", "prompt_ids", "seqs", "live", "forked", "slot", "ident", "stop_ids",
        "prompt_lps", "t_submit", "t_admit", "t_first", "done", "waited_memory", "counted", "root", "cached_tokens",
        "preemptions", "charged", "use_cache",
    )

    def __init__(self, job: GenerationJob, handle: RequestHandle, key: int):
        self.job = job
        self.handle = handle
        self.key = key  # unique per engine, in arrival order: the adapter cache's waiter id
        self.prompt_ids: list[int] = []
        self.seqs: list[_Seq] = []
        self.live = 0  # sequences not done
        self.forked = False  # the prompt is in and every sequence has its first token
        self.slot = -1
        self.ident: str | None = None  # identity of the adapter pinned in `slot` (released when it stops running)
        self.stop_ids: frozenset[int] = frozenset()
        self.prompt_lps: list | None = None  # prompt logprob entries (echo); the first token's logprob is None
        self.t_submit = time.perf_counter()
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.done = False
        self.waited_memory = False  # counted once in admissions_waited_memory
        self.counted = False  # counted in its tenant's active requests (engine._active)
        self.root = b""  # its prefix-cache chain's root: (tenant, adapter identity, cache salt)
        self.cached_tokens = 0  # prompt tokens taken from the prefix cache at its first admission
        self.preemptions = 0
        self.charged = False  # its prompt is charged to its tenant's virtual counter (once, at first admission)
        self.use_cache = True  # False while its prompt logprobs are still to compute (they need every position)

    @property
    def n(self) -> int:
        return self.job.n

    @property
    def tenant(self) -> str:
        return self.job.tenant

    def active_seqs(self) -> int:
        """Sequences that hold a slot: running, or waiting for the fork of a running prompt."""
        return sum(1 for q in self.seqs if q.state == RUN or (q.state == FORK and self.seqs[0].state == RUN))


W_PROMPT, W_OUTPUT = 1.0, 2.0  # VTC weights of a prompt token and a generated token (the paper's)


class Engine:
    def __init__(
        self,
        runner,
        loader: Callable[[str], bytes],
        *,
        max_running: int = 64,
        host_cache_bytes: int = 2 << 30,
        prefill_chunk: int = 256,
        loader_threads: int = 2,
        fair: bool = True,
        prefix_cache: bool = True,
        prefill_step_factor: float = 1.5,
        step_cost: StepCost | None = None,
        reserve_full: bool = False,
        busy_flag=None,
    ):
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.max_running = max_running
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.lora_enabled = getattr(runner, "lora", None) is not None
        self.cache = AdapterCache(runner, loader, host_cache_bytes=host_cache_bytes,
                                  loader_threads=loader_threads, on_loaded=self._wake_up) if self.lora_enabled else None
        self.metrics = EngineMetrics()
        self.block_size = int(runner.block_size)
        self.allocator = runner.kv.allocator
        self.pool = self.allocator.pool
        self.total_blocks = int(self.allocator.num_free)  # pool pages KV may ever hold (fixed slots excluded)
        self.max_context = int(runner.config.max_position_embeddings)
        self.eos_ids = self._eos_ids()
        self.prefix_cache = prefix_cache
        self.prefill_step_factor = float(prefill_step_factor)
        self.step_cost = step_cost if step_cost is not None else StepCost()
        # True: a sequence reserves the KV of prompt + max_tokens when it starts, as the engine did before KV was
        # taken on demand (issue 46); kept for comparisons (bench/scheduling.py), never for serving
        self.reserve_full = reserve_full
        # transport.busy.EngineBusyFlag (the worker's): marked while requests are in hand, for a CPU trainer on
        # the same host to hold its work meanwhile; None (tests, benches) marks nothing
        self.busy_flag = busy_flag
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiting: deque[_Request] = deque()  # requests with no running sequence: new, or all preempted
        self._running: list[_Request] = []  # requests with a running sequence
        self._by_handle: dict[int, _Request] = {}
        self._keys = itertools.count()
        self._starts = itertools.count(1)
        # Virtual token counters (Sheng et al., OSDI 2024): service received per tenant, prompt tokens weighted
        # W_PROMPT and generated tokens W_OUTPUT. Admission and the prefill budget go to the tenant with the least
        # service first; a tenant that becomes active starts at the least service the active have *received*,
        # so idle time is not banked. A prompt is charged in full at admission (the paper's rule: admission
        # order must see it at once), but prefilled in chunks over several steps; the lift of a tenant that
        # becomes active leaves the running prompts' charged-but-unprefilled tokens out — otherwise a newcomer
        # would start level with a flood's queued prompts and wait behind them in the prefill budget.
        self.fair = fair  # False: every job counts as one tenant, i.e. plain FIFO (for comparisons)
        self._vtc: dict[str, float] = defaultdict(float)
        self._active: dict[str, int] = defaultdict(int)  # tenant -> requests waiting or running
        self._weight: dict[str, float] = {}  # tenant -> its share weight (the latest job's)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False  # set when the loop has ended; submissions then fail at once

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (self.runner.config, self.tokenizer):
            for attr in ("eos_token_id", "eos_token_ids"):
                v = getattr(src, attr, None)
                if isinstance(v, int):
                    ids.add(v)
                elif isinstance(v, (list, tuple, set, frozenset)):
                    ids.update(int(x) for x in v)
        return frozenset(ids)

    # ---- public API ----------------------------------------------------------------------------

    def start(self) -> Engine:
        if self._thread is None:
            self._stopping = self._closed = False
            # the engine thread's OpenMP team should be the process's only one (inference_worker/openmp.py):
            # the starting thread, which typically built the model, gives its team back
            release_thread_team()
            self._thread = threading.Thread(target=self._loop, name="lorafleet-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the step loop; requests not finished end with error `engine_stopped`."""
        self._stopping = True
        self._wake_up()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.cache is not None:
            self.cache.close()

    def submit(self, job: GenerationJob) -> RequestHandle:
        """Thread-safe; returns at once. Validation and tokenization happen on the engine thread."""
        n = job.n if isinstance(job.n, int) and 1 <= job.n <= self.max_running else 1  # else refused in _prepare
        handle = RequestHandle(job.request_id, self, n, logprobs=job.logprobs is not None)
        self._post(("submit", handle, job))
        if self._closed:  # the loop is gone: nobody else will answer what is in the inbox
            self._fail_inbox()
        return handle

    def generate(self, job: GenerationJob, timeout: float | None = None) -> GenerationResult:
        return self.submit(job).result(timeout)

    def resident_adapters(self) -> list[str]:
        return self.cache.resident() if self.cache is not None else []

    def stats(self) -> dict:
        s = self.metrics.snapshot()
        running, waiting = list(self._running), list(self._waiting)
        s["queue_depth"] = len(waiting) + self._inbox.qsize()
        s["running"] = len(running)
        s["running_sequences"] = sum(r.active_seqs() for r in running)
        s["preempted_sequences"] = sum(1 for r in running + waiting for q in r.seqs if q.state == PREEMPTED)
        s["free_kv_blocks"] = int(self.allocator.num_free)
        s["total_kv_blocks"] = self.total_blocks
        s["prefix_cache_blocks"] = self.pool.cached_blocks
        s["prefix_cache_evictions"] = self.pool.cache_evictions
        s["step_cost"] = self.step_cost.snapshot()
        s["memory"] = self.runner.memory_report()
        if self.cache is not None:
            s["cache"] = self.cache.stats()
            s["resident_adapters"] = self.cache.resident()
        else:
            s["cache"] = {}
            s["resident_adapters"] = []
        return s

    # ---- engine thread -------------------------------------------------------------------------

    def _post(self, msg) -> None:
        self._inbox.put(msg)
        self._wake_up()

    def _wake_up(self) -> None:
        self._wake.set()

    def run_step(self) -> bool:
        """One iteration of the step loop: take the inbox, admit, run one step. False when nothing runs. The
        engine thread calls it; tests call it on an engine that was never started, to count steps."""
        self._drain_inbox()
        self._admit()
        if not self._running:
            return False
        self._step()
        return True

    def _loop(self) -> None:
        team_released = False
        while not self._stopping:
            try:
                if self.busy_flag is not None:  # before the step: a trainer holds its work from the first one on
                    self.busy_flag.set(bool(self._running or self._waiting or not self._inbox.empty()))
                if not self.run_step():
                    if self.busy_flag is not None:
                        self.busy_flag.set(False)
                    if not team_released:  # idle: no OpenMP team held for nothing (inference_worker/openmp.py)
                        team_released = release_thread_team()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                team_released = False
            except Exception:  # a bug must not kill the worker: fail what is in flight, keep serving
                log.exception("engine step failed")
                for req in list(self._running):
                    self._fail(req, ErrorCode.INTERNAL_ERROR, "the engine failed while running this request")
                self._running = [r for r in self._running if not r.done]
        self._drain_inbox()
        for req in list(self._running) + list(self._waiting):
            self._fail(req, ErrorCode.ENGINE_STOPPED, "the engine stopped before this request finished")
        self._running, self._waiting = [], deque()
        self._closed = True
        self._fail_inbox()

    def _fail_inbox(self) -> None:
        """After the loop ended: answer every submission still queued with `engine_stopped`."""
        for msg in self._take_inbox():
            if msg[0] == "submit":
                handle, job = msg[1], msg[2]
                handle._finish(GenerationResult(request_id=job.request_id, status="error",
                                                error_code=ErrorCode.ENGINE_STOPPED,
                                                error_message="the engine is not running"))

    def _take_inbox(self) -> Iterator[tuple]:
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for msg in self._take_inbox():
            if msg[0] == "submit":
                self._accept(msg[1], msg[2])
            else:
                req = self._by_handle.get(id(msg[1]))
                if req is not None and not req.done:
                    self._finish(req, "cancelled", error=(ErrorCode.CANCELLED, "cancelled by the caller"))
                    self._tidy()

    def _accept(self, handle: RequestHandle, job: GenerationJob) -> None:
        if not self.fair:
            job.tenant = ""
        req = _Request(job, handle, next(self._keys))
        self._by_handle[id(handle)] = req
        self.metrics.requests_submitted += 1
        try:
            err = self._prepare(req)
        except Exception:  # e.g. the tokenizer refusing the input: this request only
            log.exception("preparing request %s failed", job.request_id)
            err = (ErrorCode.INVALID_REQUEST, "the prompt could not be tokenized by this base's tokenizer")
        if err is not None:
            self._fail(req, *err)
            return
        t = job.tenant
        try:
            weight = float(job.tenant_weight)
        except (TypeError, ValueError):
            weight = 1.0
        self._weight[t] = weight if 0 < weight < float("inf") else 1.0
        if self._active[t] == 0:  # becomes active: no banking of idle time
            unserved: dict[str, float] = defaultdict(float)  # charged at admission, not yet prefilled
            for r in self._running:
                if not r.done and not r.forked:
                    unserved[r.tenant] += W_PROMPT * max(0, len(r.prompt_ids) - r.seqs[0].num_computed)
            others = [self._vtc[x] - unserved[x] for x, n in self._active.items() if n > 0]
            if others:
                self._vtc[t] = max(self._vtc[t], min(others))
        self._active[t] += 1
        req.counted = True
        self._waiting.append(req)

    def _prepare(self, req: _Request) -> tuple[ErrorCode, str] | None:
        """Tokenize and validate; returns (code, message) when the request cannot run."""
        job = req.job
        vocab = int(self.runner.config.vocab_size)
        params = SamplingParams.from_job(job)
        problem = params.validate(vocab)
        if problem is None and job.max_tokens < 1:
            problem = "max_tokens must be >= 1"
        if problem is None and not (isinstance(job.n, int) and 1 <= job.n <= self.max_running):
            problem = f"n must be an integer in 1..{self.max_running} (this worker's --max-running)"
        if problem is None and job.prompt_logprobs is not None and not 0 <= int(job.prompt_logprobs) <= 20:
            problem = "prompt_logprobs must be in 0..20"
        if problem is not None:
            return ErrorCode.INVALID_REQUEST, problem
        if job.adapter is not None and not self.lora_enabled:
            return ErrorCode.ADAPTER_LOAD_FAILED, "this worker runs with LoRA disabled and serves the base model only"
        if job.prompt_token_ids is not None:
            ids = [int(t) for t in job.prompt_token_ids]
        else:
            ids = self.tokenizer.encode(job.prompt or "", add_special_tokens=True)
        if not ids:
            return ErrorCode.INVALID_REQUEST, "the prompt is empty"
        if any(t < 0 or t >= vocab for t in ids):
            return ErrorCode.INVALID_REQUEST, f"prompt token ids must be in 0..{vocab - 1}"
        req.prompt_ids = ids
        if len(ids) + job.max_tokens > self.max_context:
            return ErrorCode.PROMPT_TOO_LONG, (
                f"prompt of {len(ids)} tokens + max_tokens {job.max_tokens} exceeds the context of {self.max_context}"
            )
        need = blocks_needed(len(ids) + 1, self.block_size)  # the prompt and the first generated token
        if need > self.total_blocks:
            return ErrorCode.PROMPT_TOO_LONG, (
                f"prompt of {len(ids)} tokens needs more KV cache than this worker has "
                f"({self.total_blocks * self.block_size} positions)")
        if job.adapter is not None and not self.runner.lora.fixed_pages:
            pages = self._adapters.pages_for(job.adapter)
            if pages + need > self.total_blocks:
                return ErrorCode.ADAPTER_TOO_LARGE, (
                    f"adapter {job.adapter.name or job.adapter.sha256[:12]} (rank {job.adapter.rank}) takes {pages} "
                    f"pages of this worker's memory pool; with this request's {need} KV blocks that exceeds the "
                    f"pool's {self.total_blocks} pages")
        req.seqs = [_Seq(req, i, SequenceSampling(params, ids, index=i), IncrementalText(self.tokenizer, ids, job.stop),
                         logprobs=params.logprobs is not None) for i in range(job.n)]
        req.live = len(req.seqs)
        req.stop_ids = frozenset(int(t) for t in job.stop_token_ids)
        if job.prompt_logprobs is not None:
            req.prompt_lps = [{"token": ids[0], "logprob": None, "top": None}]  # nothing comes before it
        req.use_cache = self.prefix_cache and job.prompt_logprobs is None
        req.root = root_key(job.tenant, job.adapter.identity if job.adapter is not None else None,
                            str(job.cache_salt or ""))
        return None

    @property
    def _adapters(self) -> AdapterCache:
        """The adapter cache. Only requests with an adapter reach it, and a LoRA-disabled engine (no cache)
        refuses those in _prepare."""
        return cast(AdapterCache, self.cache)

    # ---- shares and preemption ---------------------------------------------------------------------

    def _share(self, tenant: str, capacity: float) -> float:
        """`tenant`'s share of `capacity`: its weight over the weights of every tenant with work here."""
        total = sum(self._weight.get(t, 1.0) for t, n in self._active.items() if n > 0)
        w = self._weight.get(tenant, 1.0)
        return capacity * w / (total if total > 0 else w)

    def _usage(self) -> tuple[dict[str, int], dict[str, int], dict[str, _Seq]]:
        """Per tenant: the sequence slots and the KV blocks its running sequences hold, and its most recently
        started running sequence (the first to preempt)."""
        slots: dict[str, int] = defaultdict(int)
        blocks: dict[str, int] = defaultdict(int)
        latest: dict[str, _Seq] = {}
        for r in self._running:
            slots[r.tenant] += r.active_seqs()
            for q in r.seqs:
                if q.state == RUN:
                    blocks[r.tenant] += len(q.blocks)
                    if r.tenant not in latest or q.started > latest[r.tenant].started:
                        latest[r.tenant] = q
        return slots, blocks, latest

    def _free_slots(self) -> int:
        return self.max_running - sum(r.active_seqs() for r in self._running)

    def _room_for_tenant(self, tenant: str, slots: int, blocks: int) -> bool:
        """Make `slots` free sequence slots and `blocks` free KV blocks for `tenant`'s waiting work by preempting
        tenants above their share, if `tenant` stays within its own with them. The most-above tenant (usage over
        weight) gives first, its most recently started sequence first, and no tenant is taken below its share."""
        if blocks and self.allocator.num_free < blocks and self.cache is not None:
            self.cache.reclaim(blocks)
        while True:
            short_slots = slots - self._free_slots()
            short_blocks = blocks - self.allocator.num_free
            if short_slots <= 0 and short_blocks <= 0:
                return True
            used_slots, used_blocks, latest = self._usage()
            if short_slots > 0:
                used, capacity, want = used_slots, self.max_running, slots
            else:
                used, capacity, want = used_blocks, self.total_blocks, blocks
            if used[tenant] + want > self._share(tenant, capacity):
                return False  # it would be above its share: it waits for what others give back
            over = [t for t in latest if t != tenant and used[t] > self._share(t, capacity)]
            if not over:
                return False
            victim_tenant = max(over, key=lambda t: (used[t] / self._weight.get(t, 1.0), used[t]))
            self._preempt(latest[victim_tenant])
            self.metrics.preemptions_for_share += 1

    def _grow(self, seq: _Seq, need: int) -> bool:
        """Give running `seq` `need` more KV blocks. When the pool has too few free pages (cached blocks count as
        free: they are evicted first), idle adapters are evicted, then the tenant most above its KV share (blocks
        over weight) gives back its most recently started sequence, until there is room. False, with nothing
        allocated, when the sequence to preempt would be `seq` itself."""
        while self.allocator.num_free < need:
            if self.cache is not None and self.cache.reclaim(need):
                break
            _, held, latest = self._usage()
            holders = [t for t in latest if latest[t].blocks]
            if not holders:
                return False
            victim = latest[max(holders, key=lambda t: (held[t] / self._weight.get(t, 1.0), held[t]))]
            if victim is seq:
                return False
            self._preempt(victim)
        seq.blocks += self.allocator.allocate(need)
        return True

    def _preempt(self, seq: _Seq) -> None:
        """Recompute later: `seq` gives back its KV blocks and keeps its tokens, sampler, text and logprobs. A
        request's first sequence preempted before its prompt is in takes its waiting siblings along."""
        req = seq.req
        self.metrics.preemptions += 1
        req.preemptions += 1
        if seq.blocks:
            self.allocator.free(seq.blocks)
        seq.blocks, seq.keys = [], []
        seq.recompute_upto = max(seq.recompute_upto, seq.num_computed)
        seq.num_computed = 0
        seq.state = PREEMPTED

    def _tidy(self) -> None:
        """Requests with a running sequence in `_running` (in the order they started), the others in `_waiting`
        (in arrival order). A request that stops running gives back its adapter pin while it waits (so waiting
        requests never hold pages that running ones need)."""
        running, parked = [], []
        for r in self._running:
            if r.done:
                continue
            if any(q.state == RUN for q in r.seqs):
                running.append(r)
            else:
                if r.ident is not None:
                    self._adapters.release(r.ident)
                    r.slot, r.ident = -1, None
                parked.append(r)
        waiting = []
        seen = {id(r) for r in running}
        for r in self._waiting:
            if r.done or id(r) in seen:
                continue
            if any(q.state == RUN for q in r.seqs):
                running.append(r)
            else:
                waiting.append(r)
        self._running = running
        self._waiting = deque(sorted(waiting + parked, key=lambda r: r.key))

    # ---- admission ---------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Start waiting work — new requests, and preempted sequences of waiting or running ones — in fair order:
        the tenant with the least virtual service first, each tenant's work in arrival order. Bounded by
        max_running (sequences) and by the memory pool, which KV blocks and resident adapters share; a tenant
        within its share may preempt tenants above theirs (_room_for_tenant). Work that cannot start while its
        tenant is within its share holds the line (nothing behind it takes the slots or pages it waits for, so it
        cannot starve); a tenant above its share steps aside. A request whose adapter is still loading does not
        hold the line."""
        pending = [r for r in self._waiting if not r.done]
        pending += [r for r in self._running if any(q.state in (WAIT, PREEMPTED) for q in r.seqs)]
        if not pending:
            return
        queues: dict[str, deque[_Request]] = defaultdict(deque)
        for req in sorted(pending, key=lambda r: r.key):
            queues[req.tenant].append(req)
        heap = [(self._vtc[t], q[0].key, t) for t, q in queues.items()]
        heapq.heapify(heap)
        while heap:
            _, _, t = heapq.heappop(heap)
            req = queues[t][0]
            outcome = self._start(req)
            if outcome in ("full", "blocked"):
                used_slots, used_blocks, _ = self._usage()
                if (used_slots[t] < self._share(t, self.max_running)
                        and used_blocks[t] < self._share(t, self.total_blocks)):
                    break  # within its share: the line stops here
                continue  # above its share: the others go first
            queues[t].popleft()
            if queues[t]:
                heapq.heappush(heap, (self._vtc[t], queues[t][0].key, t))
        self._tidy()

    def _start(self, req: _Request) -> str:
        """Start every sequence of `req` that waits, in index order: 'started', 'failed', 'loading' (its adapter
        loads off-thread), 'full' (no sequence slot) or 'blocked' (waits for memory)."""
        ref = req.job.adapter
        if ref is not None and req.ident is None:
            got = self._adapters.acquire(ref, req.key)
            if got.state == FAILED:
                self._fail(req, got.error_code or ErrorCode.ADAPTER_LOAD_FAILED, got.error_message or "")
                return "failed"
            if got.state == LOADING:
                return "loading"
            if got.state == NO_ROOM:  # pinned adapters and KV blocks leave no run of pages for it
                self._wait_for_memory(req)
                return "blocked"
            req.slot, req.ident = got.slot, ref.identity
        for seq in req.seqs:
            if seq.state in (WAIT, PREEMPTED):
                outcome = self._start_seq(seq)
                if outcome != "started":
                    if req.ident is not None and not any(q.state == RUN for q in req.seqs):
                        self._adapters.release(req.ident)  # wait unpinned: it stays resident unless room is needed
                        req.slot, req.ident = -1, None
                    return outcome
        return "started"

    def _start_seq(self, seq: _Seq) -> str:
        req = seq.req
        t = req.tenant
        first_start = req.t_admit is None
        slots = 1 + (sum(1 for q in req.seqs if q.state == FORK) if seq.index == 0 and not req.forked else 0)
        if self._free_slots() < slots and not self._room_for_tenant(t, slots, 0):
            return "full"
        cached = self._take_cached(seq) if (req.use_cache or req.forked) else 0
        upto = min(seq.length, seq.num_computed + self.prefill_chunk)
        if self.reserve_full:
            upto = max(upto, len(req.prompt_ids) + req.job.max_tokens)
        need = blocks_needed(upto, self.block_size) - len(seq.blocks)
        # keep a little room for the running sequences to grow into (none when nothing runs: a prompt that fits
        # the pool alone must always start)
        spare = max(1, self.total_blocks // 100) if self._running else 0
        if self.allocator.num_free < need + spare and not self._room_for_tenant(t, 0, need + spare):
            if seq.blocks:
                self.allocator.free(seq.blocks)
            seq.blocks, seq.keys, seq.num_computed = [], [], 0
            self._wait_for_memory(req)
            return "blocked"
        seq.blocks += self.allocator.allocate(need)
        seq.state = RUN
        if not seq.started:  # a resumed sequence keeps its place: preempting it again would re-read it all again
            seq.started = next(self._starts)
        if first_start:
            req.t_admit = time.perf_counter()
            req.cached_tokens = cached
            self.metrics.sequences += req.n
            self.metrics.prefix_cache_query_tokens += len(req.prompt_ids) if req.use_cache else 0
            self.metrics.prefix_cache_hit_tokens += cached
        if not req.charged:  # the prompt is read once, whatever n; what the cache gave is not charged
            req.charged = True
            self._vtc[t] += W_PROMPT * (len(req.prompt_ids) - cached)
        if req not in self._running:
            self._running.append(req)
        return "started"

    def _take_cached(self, seq: _Seq) -> int:
        """Take the longest run of cached blocks at the start of `seq`'s tokens (always leaving its last token
        to compute: its logits are the next token's); returns the tokens they hold."""
        req = seq.req
        if not self.prefix_cache or seq.blocks:
            return 0
        full = (seq.length - 1) // self.block_size
        if full <= 0:
            return 0
        keys = chain(req.root, seq.tokens(0, full * self.block_size), self.block_size)
        got: list[int] = []
        for k in keys:
            b = self.allocator.cached(k)
            if b is None:
                break
            got.append(b)
        for b in got:
            self.allocator.take_cached(b)
        seq.blocks, seq.keys = got, keys[:len(got)]
        seq.num_computed = len(got) * self.block_size
        return seq.num_computed

    def _key_blocks(self, seq: _Seq) -> None:
        """Key the blocks `seq` has filled, so later requests of its tenant and adapter can reuse them."""
        full = seq.num_computed // self.block_size
        if not self.prefix_cache or full <= len(seq.keys):
            return
        old = len(seq.keys)
        chain(seq.req.root, seq.tokens(0, full * self.block_size), self.block_size, seq.keys)
        for i in range(old, full):
            self.allocator.key(seq.blocks[i], seq.keys[i])

    def _wait_for_memory(self, req: _Request) -> None:
        if not req.waited_memory:
            req.waited_memory = True
            self.metrics.admissions_waited_memory += 1

    # ---- one step ------------------------------------------------------------------------------------

    def _step(self) -> None:
        t0 = time.perf_counter()
        bs = self.block_size
        # 1. Decodes take a new block at each block boundary, oldest first; when the pool runs out the tenant most
        #    above its KV share gives back its newest sequence (_grow). A sequence that is itself the one to give
        #    way is preempted; one alone in a pool it has outgrown ends with "length".
        runnable = sorted((q for r in self._running for q in r.seqs if q.state == RUN), key=lambda q: q.started)
        for q in runnable:
            if q.state != RUN or q.length - q.num_computed != 1:
                continue
            need = blocks_needed(q.num_computed + 1, bs) - len(q.blocks)
            if need > 0 and not self._grow(q, need):
                if any(o is not q and o.state == RUN and o.blocks for r in self._running for o in r.seqs):
                    self._preempt(q)
                else:
                    self._finish_seq(q, "length")
        decodes = [q for q in runnable if q.state == RUN and q.length - q.num_computed == 1]
        allowance: float | None = None  # seconds that work beyond the protected decodes may add, when bounded
        decodes, allowance = self._bound_decodes(decodes)
        decode_shape = StepShape()
        for q in decodes:
            decode_shape.add(q.num_computed, 1)
        decode_tenants = {q.req.tenant for q in decodes}

        # 2. Prefill chunks. The budget goes to the tenant with the least service first (VTC), and within a tenant
        #    in start order, so an old long prompt is not starved by its own tenant's newer ones. Another tenant's
        #    chunk rides in the same step only if it is no longer than what the least-served tenant reads in it.
        #    When other tenants' decodes ride, the chunks are cut so the step costs at most prefill_step_factor
        #    times the decodes alone (step_cost.py; at least one token for the first chunk: no starvation).
        budget = self.prefill_chunk
        lead: str | None = None  # the tenant first given prefill budget in this step
        lead_tokens = 0
        chunks: list[tuple[_Seq, int]] = []
        prefills = [q for q in runnable if q.state == RUN and q.length - q.num_computed > 1]
        prefills.sort(key=lambda q: (self._vtc[q.req.tenant], q.started))
        for q in prefills:
            if budget <= 0:
                break
            if q.state != RUN:  # preempted for an earlier chunk's blocks
                continue
            t = q.req.tenant
            start = q.num_computed
            n = min(q.length - start, budget)
            if decode_tenants - {t}:
                if allowance is None:
                    allowance = (self.prefill_step_factor - 1.0) * self.step_cost.predict(decode_shape)
                n = self.step_cost.prefill_bound(start, n, allowance, floor=0 if chunks else 1)
                if n <= 0:
                    continue
            if lead is None:
                lead = t
            elif t != lead and n > lead_tokens:
                continue
            need = blocks_needed(start + n, bs) - len(q.blocks)
            if need > 0 and not self._grow(q, need):
                n = min(n, (len(q.blocks) + self.allocator.num_free) * bs - start)  # what the free pages hold
                if n <= 0:
                    continue
                q.blocks += self.allocator.allocate(blocks_needed(start + n, bs) - len(q.blocks))
            if allowance is not None:
                allowance -= self.step_cost.added_seconds(start, n)
            if t == lead:
                lead_tokens += n
            budget -= n
            chunks.append((q, n))

        # 3. One forward over the decodes and the chunks, each adapter's tokens contiguous.
        work = [(q, 1) for q in decodes if q.state == RUN] + [(q, n) for q, n in chunks if q.state == RUN]
        if not work:
            self._tidy()
            self._wake.wait(0.01)  # everything waits for memory that a loading adapter or a cancel will free
            self._wake.clear()
            return
        batch = [(q, SeqStep(block_table=q.blocks, start_pos=q.num_computed,
                             token_ids=q.tokens(q.num_computed, q.num_computed + n), slot=q.req.slot))
                 for q, n in work]
        batch.sort(key=lambda b: b[1].slot)  # stable: each adapter's tokens contiguous
        steps = [b[1] for b in batch]
        shape = StepShape()
        for s in steps:
            shape.add(s.start_pos, len(s.token_ids))
        every = [i for i, (q, _) in enumerate(batch)
                 if not q.req.forked and q.req.prompt_lps is not None and len(q.req.prompt_lps) < len(q.req.prompt_ids)]

        tf = time.perf_counter()
        logits, failed, prompt_logits = self._forward(steps, every)  # [len(steps), vocab]
        forward_s = time.perf_counter() - tf

        rows: list[int] = []  # logits row of each sequence that takes a token now
        seqs: list[_Seq] = []
        preempt_after: list[_Seq] = []  # siblings that found no block for their copy at the fork
        for i, (q, step) in enumerate(batch):
            req = q.req
            if req.done or q.state != RUN:
                continue
            if i in failed:
                self._fail(req, ErrorCode.INTERNAL_ERROR, f"the forward pass failed for this request: {failed[i]}")
                continue
            start, n = step.start_pos, len(step.token_ids)
            again = max(0, min(start + n, q.recompute_upto) - start)
            self.metrics.recomputed_tokens += again
            if not req.forked:
                self.metrics.prefill_tokens += n - again
            try:
                if i in prompt_logits:
                    self._add_prompt_logprobs(req, step, prompt_logits[i])
            except Exception as exc:  # this request only
                log.exception("prompt logprobs of request %s failed", req.job.request_id)
                self._fail(req, ErrorCode.INTERNAL_ERROR, f"computing prompt logprobs failed: {exc!r}")
                continue
            q.num_computed += n
            self._key_blocks(q)
            if q.num_computed < q.length:
                continue  # more of its prompt (or of what it re-reads) to come
            if req.forked:
                rows.append(i)
                seqs.append(q)
                continue
            preempt_after += self._fork(req)  # the prompt is in: every sequence samples from this row
            live = [s for s in req.seqs if not s.done]
            rows += [i] * len(live)
            seqs += live
        if rows:
            if rows == list(range(len(batch))):
                sel = logits
            else:
                sel = logits.index_select(0, torch.tensor(rows, dtype=torch.int64, device=logits.device))
            out = sample_step(sel, [q.sampling for q in seqs])
            now = time.perf_counter()
            for row, (seq, tok) in enumerate(zip(seqs, out.tokens, strict=True)):
                req = seq.req
                if req.done:
                    continue
                if row in out.failed:
                    bad = out.failed[row]
                    code = ErrorCode.NON_FINITE_LOGITS if isinstance(bad, NonFiniteLogits) else ErrorCode.INTERNAL_ERROR
                    self._fail(req, code, str(bad) or repr(bad))
                    continue
                try:
                    self._on_token(seq, tok, out.logprobs.get(row), now)
                except Exception as exc:  # detokenization or a stop check failing: this request only
                    log.exception("request %s failed after its forward pass", req.job.request_id)
                    self._fail(req, ErrorCode.INTERNAL_ERROR, f"post-processing a token failed: {exc!r}")
        for seq in preempt_after:
            if seq.state == RUN and not seq.done:
                self._preempt(seq)
        self._tidy()
        step_s = time.perf_counter() - t0
        # the whole step, not only its forward: sampling and bookkeeping grow with the rows too, and a token's
        # wait is the step's
        self.step_cost.observe(shape, step_s)
        self.metrics.record_step(
            batch_size=len(steps), tokens=shape.tokens,
            distinct_adapters=len({s.slot for s in steps}), forward_s=forward_s, step_s=step_s,
        )

    def _bound_decodes(self, decodes: list[_Seq]) -> tuple[list[_Seq], float | None]:
        """The decode rows this step runs. On a CPU a step's time grows with its rows, so a tenant above its share
        of the sequence slots would slow every token of a tenant within its own: while a tenant within its share
        decodes, the rows of tenants above theirs ride, oldest first, only while the step stays within
        prefill_step_factor times the cost of the protected rows alone (at least one of them a step, so they
        never stall); the others wait this step out, keeping their KV. Returns the rows and the seconds of
        allowance left for prefill chunks (None when nothing is bounded)."""
        if not decodes or not self.fair:
            return decodes, None
        slots, _, _ = self._usage()
        over = {t for t in {q.req.tenant for q in decodes} if slots[t] > self._share(t, self.max_running)}
        keep = [q for q in decodes if q.req.tenant not in over]
        if not over or not keep:
            return decodes, None
        base = StepShape()
        for q in keep:
            base.add(q.num_computed, 1)
        allowance = (self.prefill_step_factor - 1.0) * self.step_cost.predict(base)
        first = True
        for q in sorted((q for q in decodes if q.req.tenant in over), key=lambda q: q.started):
            cost = self.step_cost.added_seconds(q.num_computed, 1)
            if cost <= allowance or first:
                keep.append(q)
                allowance -= cost
                first = False
            else:
                self.metrics.decode_rows_deferred += 1
        return keep, max(0.0, allowance)

    def _fork(self, req: _Request) -> list[_Seq]:
        """The prompt is in the first sequence's blocks: the others share its full blocks, copy its partial last
        block into one of their own, and start at the same position. Returns the siblings that found no free
        page for that copy: they take their first token with the others and are then preempted (they re-read
        the prompt later, mostly from the prefix cache)."""
        self.metrics.prompt_prefills += 1
        req.forked = True
        first = req.seqs[0]
        length = len(req.prompt_ids)
        full = length // self.block_size
        short: list[_Seq] = []
        for q in req.seqs[1:]:
            if q.done:
                continue
            q.blocks = list(first.blocks[:full])
            if full:
                self.allocator.share(q.blocks, 1)
                self.metrics.kv_blocks_shared += full
            q.keys = list(first.keys[:full])
            if length % self.block_size:
                if self.allocator.num_free:
                    b = self.allocator.allocate(1)[0]
                    self.runner.kv.copy_blocks([first.blocks[full]], [b])
                    self.metrics.kv_blocks_copied += 1
                    q.blocks.append(b)
                else:
                    short.append(q)
            q.num_computed = length
            q.state = RUN
            q.started = next(self._starts)
        if req.prompt_lps is not None:
            req.handle._publish_prompt(req.prompt_lps)
        return short

    def _add_prompt_logprobs(self, req: _Request, step: SeqStep, logits: torch.Tensor) -> None:
        """Logits at prompt positions start..start+n-1 predict prompt tokens start+1..start+n (the last of a
        final chunk predicts the first generated token: not a prompt token). Positions a preempted prompt had
        already covered are not added again."""
        start, ids, entries = step.start_pos, req.prompt_ids, req.prompt_lps
        if entries is None:
            return
        m = min(len(step.token_ids), len(ids) - 1 - start)
        skip = max(0, len(entries) - 1 - start)
        if m > skip:
            entries += prompt_logprobs(logits[skip:m], ids[start + 1 + skip: start + 1 + m], req.job.prompt_logprobs or 0)

    def _forward(self, steps: list, every: Collection[int] = ()) -> tuple[torch.Tensor, dict[int, str], dict]:
        """One forward pass; if it raises, each sequence alone, so one bad request fails alone.
        (Re-running a step rewrites the same KV entries with the same values.) `every`: steps that also want
        logits at every token (prompt logprobs)."""
        try:
            if every:
                logits, extra = self.runner.forward_all_positions(steps, every)
                return logits, {}, extra
            return self.runner.forward(steps), {}, {}
        except Exception as exc:
            log.warning("batched forward failed (%r); isolating", exc)
        rows, failed, extra = [], {}, {}
        vocab = int(self.runner.config.vocab_size)
        for i, s in enumerate(steps):
            try:
                if i in every:
                    logits, more = self.runner.forward_all_positions([s], [0])
                    rows.append(logits[0])
                    extra[i] = more[0]
                else:
                    rows.append(self.runner.forward([s])[0])
            except Exception as exc:
                failed[i] = repr(exc)
                rows.append(torch.zeros(vocab))
        dev = next((r.device for r in rows), "cpu")
        return torch.stack([r.to(dev) for r in rows]), failed, extra

    def _on_token(self, seq: _Seq, tok: int, logprob: dict | None, now: float) -> None:
        req = seq.req
        if req.t_first is None:
            req.t_first = now
        seq.out_ids.append(tok)
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append(logprob)
        self.metrics.tokens_generated += 1
        self._vtc[req.tenant] += W_OUTPUT
        job = req.job
        if tok in req.stop_ids or (tok in self.eos_ids and not job.ignore_eos):
            self._finish_seq(seq, "stop")
            return
        if seq.text.append(tok):
            self._finish_seq(seq, "stop")
            return
        if len(seq.out_ids) >= job.max_tokens:
            self._finish_seq(seq, "length")
            return
        req.handle._publish(seq.index, seq.text.text[: seq.text.stable_text_len(False)], seq.logprobs)

    def _finish_seq(self, seq: _Seq, reason: str) -> None:
        """One choice is done: its own blocks (and its hold on the shared ones) go back at once; the request
        ends with its last sequence."""
        seq.done, seq.finish_reason, seq.state = True, reason, DONE
        seq.text.flush()
        seq.req.handle._publish(seq.index, seq.text.text, seq.logprobs)
        if seq.blocks:
            self.allocator.free(seq.blocks)
            seq.blocks = []
        req = seq.req
        req.live -= 1
        if req.live == 0:
            self._finish(req, seq.req.seqs[0].finish_reason)

    def _release(self, req: _Request, scrub: bool = False) -> None:
        held = [seq.blocks for seq in req.seqs if seq.blocks]
        if scrub and held:
            # A failed request may leave NaN/inf keys, which padded gathers of later sequences would read: zero
            # the pages only it holds, and forget their cache keys (pages shared with others are theirs too).
            mine = sorted({b for blocks in held for b in blocks if self.allocator.refs(b) == 1})
            if mine:
                self.pool.forget_blocks(mine)
                self.runner.pool.data[:, mine] = 0
        for seq in req.seqs:
            if seq.blocks:
                self.allocator.free(seq.blocks)
                seq.blocks = []
        if req.ident is not None:
            self._adapters.release(req.ident)
            req.ident = None
        elif req.job.adapter is not None and self.cache is not None:
            self.cache.forget(req.key)

    def _finish(self, req: _Request, reason: str | None, error: tuple[ErrorCode, str] | None = None) -> None:
        if req.done:
            return
        req.done = True
        for seq in req.seqs:  # sequences still running end with the request (cancelled, or failed)
            if not seq.done:
                seq.done, seq.finish_reason, seq.state = True, reason, DONE
                if reason != "cancelled" and seq.text is not None:
                    seq.text.flush()
        req.live = 0
        self._release(req, scrub=error is not None and error[0] != ErrorCode.CANCELLED)
        if req.counted:  # it was waiting or running: its tenant has one request fewer in the engine
            req.counted = False
            self._active[req.tenant] -= 1
        self._by_handle.pop(id(req.handle), None)
        now = time.perf_counter()
        job = req.job
        if error is None:
            self.metrics.requests_finished += 1
        elif error[0] == ErrorCode.CANCELLED:
            self.metrics.requests_cancelled += 1
        else:
            self.metrics.requests_failed += 1
        self.metrics.prompt_tokens += len(req.prompt_ids)
        choices = [Choice(index=seq.index, text=seq.text.text if seq.text is not None else "",
                          token_ids=list(seq.out_ids), finish_reason=seq.finish_reason, logprobs=seq.logprobs)
                   for seq in req.seqs]
        first = choices[0] if choices else Choice(0, finish_reason=reason)
        served = job.adapter if req.t_admit is not None else None  # what the cache verified and placed
        req.handle._finish(GenerationResult(
            request_id=job.request_id,
            status="ok" if error is None else "error",
            error_code=None if error is None else error[0],
            error_message=None if error is None else error[1],
            token_ids=list(first.token_ids),
            text=first.text,
            finish_reason=first.finish_reason if error is None else reason,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=sum(len(c.token_ids) for c in choices),
            adapter_sha256=served.sha256 if served is not None else None,
            adapter_identity=served.identity if served is not None else None,
            adapter_dtype=self.runner.adapter_dtype_name if served is not None else None,
            queued_s=((req.t_admit or now) - req.t_submit),
            first_token_s=None if req.t_first is None else req.t_first - req.t_submit,
            total_s=now - req.t_submit,
            choices=choices,
            prompt_logprobs=req.prompt_lps,
            cached_tokens=req.cached_tokens,
            preemptions=req.preemptions,
        ))

    def _fail(self, req: _Request, code: ErrorCode, message: str) -> None:
        self._finish(req, None, error=(code, message))
