"""The engine: one thread that runs continuous (iteration-level) batching over one ModelRunner.

Any thread may `submit(job)`; the engine thread, at every step,
  1. takes new jobs and cancellations from its inbox,
  2. admits waiting requests in arrival order (FCFS) while KV blocks and adapter slots allow,
  3. builds one batch: a prefill chunk for requests still reading their prompt (a per-step token budget
     chunks long prompts) and one decode token for the others, ordered so that each adapter's tokens are
     contiguous (the segments SGMV consumes), and runs ONE `runner.forward` over all of it,
  4. samples, checks stop conditions, streams text, and retires finished requests at once, freeing
     their KV blocks and unpinning their adapters.

Memory (one pool for KV blocks and adapters, memory_pool.py). KV blocks for a request's whole budget
(prompt + max_tokens) are reserved at admission, so a running request can never run out of cache and
nothing needs preempting; the price is that a request that stops early held blocks it did not use until
it finished. Under pressure the engine *queues*: a request whose KV blocks or adapter pages are not free
waits (idle adapters are evicted first, least recently used, to give pages back), and counts once in
`admissions_waited_memory`. It *refuses* at once only what can never fit: prompt + max_tokens beyond the
pool (`prompt_too_long`), or an adapter whose pages plus the request's KV exceed the pool
(`adapter_too_large`). It never preempts a running request.

Fairness: a request whose adapter is still loading (off-thread) does not hold up those behind it; a
request that waits for memory does, so nothing later can keep taking the pages it waits for (no
starvation).

Failures are per request: a bad adapter, an over-long prompt or bad parameters end that request with an
error code; if a forward pass raises, the batch is re-run sequence by sequence to find the culprit.

n > 1 (several choices for one prompt): the prompt is prefilled ONCE, into the first sequence's blocks. At
admission the request reserves the prompt's full blocks once and, per sequence, the blocks for the rest
(the prompt's partial last block and max_tokens); the full prompt blocks are reference-counted in the pool
and shared by all n block tables. When the prompt is done, the n sequences fork: each takes a first token
from the same logits (its own sampler, its own derived seed), the partial last block is copied into each
other sequence's own block (copy-on-write: the shared blocks are only ever read), and from then on they
decode as n rows of the batch. `prompt_prefills` / `sequences` / `prefill_tokens` in stats() count it.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
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
from .metrics import EngineMetrics
from .model import SeqStep
from .openmp import release_thread_team
from .sampling import IncrementalText, NonFiniteLogits, SamplingParams, SequenceSampling, prompt_logprobs, sample_step

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


class _Seq:
    """One of a request's n sequences (choices): its block table (the prompt's full blocks shared with its
    siblings), its tokens, sampling state and text."""

    __slots__ = ("req", "index", "blocks", "num_computed", "out_ids", "sampling", "text", "done", "finish_reason",
                 "logprobs")

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


class _Request:
    """Engine-private state of one request: its prompt (prefilled once) and its n sequences."""

    __slots__ = (
        "job", "handle", "key", "prompt_ids", "seqs", "live", "prefilled", "slot", "ident", "stop_ids",
        "prompt_lps", "t_submit", "t_admit", "t_first", "done", "waited_memory", "counted",
    )

    def __init__(self, job: GenerationJob, handle: RequestHandle, key: int):
        self.job = job
        self.handle = handle
        self.key = key  # unique per engine: the adapter cache's waiter id
        self.prompt_ids: list[int] = []
        self.seqs: list[_Seq] = []
        self.live = 0  # sequences not done
        self.prefilled = 0  # prompt tokens in the KV cache (in the first sequence's blocks)
        self.slot = -1
        self.ident: str | None = None  # identity of the adapter pinned in `slot` (released when the request ends)
        self.stop_ids: frozenset[int] = frozenset()
        self.prompt_lps: list | None = None  # prompt logprob entries (echo); the first token's logprob is None
        self.t_submit = time.perf_counter()
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.done = False
        self.waited_memory = False  # counted once in admissions_waited_memory
        self.counted = False  # counted in its tenant's active requests (engine._active)

    @property
    def n(self) -> int:
        return self.job.n


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
        self.total_blocks = int(self.allocator.num_free)  # pool pages KV may ever hold (fixed slots excluded)
        self.max_context = int(runner.config.max_position_embeddings)
        self.eos_ids = self._eos_ids()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._by_handle: dict[int, _Request] = {}
        self._keys = itertools.count()
        # Virtual token counters (Sheng et al., "Fairness in Serving LLMs", OSDI 2024): service received per
        # tenant, prompt tokens weighted W_PROMPT and generated tokens W_OUTPUT. Admission and the prefill
        # budget go to the tenant with the least service first; a tenant that becomes active starts at the
        # least service the active have *received*, so idle time is not banked. Work-conserving: one busy
        # tenant gets everything.
        # A prompt is charged in full at admission (the paper's rule: admission order must see it at once),
        # but prefilled in chunks over several steps. The lift of a tenant that becomes active leaves the
        # running requests' charged-but-unprefilled prompt tokens out — otherwise a newcomer would start level
        # with the flood's queued prompts and wait behind them in the prefill budget.
        self.fair = fair  # False: every job counts as one tenant, i.e. plain FIFO (for comparisons)
        self._vtc: dict[str, float] = defaultdict(float)
        self._active: dict[str, int] = defaultdict(int)  # tenant -> requests waiting or running
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
        s["queue_depth"] = len(self._waiting) + self._inbox.qsize()
        s["running"] = len(self._running)
        s["running_sequences"] = sum(r.live for r in self._running)
        s["free_kv_blocks"] = int(self.allocator.num_free)
        s["total_kv_blocks"] = self.total_blocks
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

    def _loop(self) -> None:
        team_released = False
        while not self._stopping:
            try:
                self._drain_inbox()
                self._admit()
                if not self._running:
                    if not team_released:  # idle: no OpenMP team held for nothing (inference_worker/openmp.py)
                        team_released = release_thread_team()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                team_released = False
                self._step()
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
                    self._running = [r for r in self._running if not r.done]

    def _accept(self, handle: RequestHandle, job: GenerationJob) -> None:
        if not self.fair:
            job.tenant = ""
        req = _Request(job, handle, next(self._keys))
        self._by_handle[id(handle)] = req
        self.metrics.requests_submitted += 1
        try:
            err = self._prepare(req)
        except Exception as exc:  # e.g. the tokenizer refusing the input: this request only
            log.exception("preparing request %s failed", job.request_id)
            err = (ErrorCode.INVALID_REQUEST, f"the prompt could not be prepared: {exc}")
        if err is not None:
            self._fail(req, *err)
        else:
            t = job.tenant
            if self._active[t] == 0:  # becomes active: no banking of idle time
                unserved: dict[str, float] = defaultdict(float)  # charged at admission, not yet prefilled
                for r in self._running:
                    if not r.done:
                        unserved[r.job.tenant] += W_PROMPT * (len(r.prompt_ids) - r.prefilled)
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
        need = self._blocks_needed(req)
        if need > self.total_blocks:
            choices = f" for each of {job.n} choices" if job.n > 1 else ""
            return ErrorCode.PROMPT_TOO_LONG, (
                f"prompt of {len(ids)} tokens + max_tokens {job.max_tokens}{choices} needs more KV cache than this "
                f"worker has")
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
        return None

    def _block_split(self, req: _Request) -> tuple[int, int]:
        """(full prompt blocks, shared by all sequences; blocks each sequence owns: its partial prompt block
        and the rest of its budget)."""
        per_seq = math.ceil((len(req.prompt_ids) + req.job.max_tokens) / self.block_size)
        shared = len(req.prompt_ids) // self.block_size if req.n > 1 else 0
        return shared, per_seq - shared

    def _blocks_needed(self, req: _Request) -> int:
        shared, own = self._block_split(req)
        return shared + req.n * own

    def _admit(self) -> None:
        """Admission bounded by max_running (sequences) and by the memory pool, which KV blocks and resident
        adapters share, in fair order: the tenant with the least virtual service first, each tenant's requests
        in arrival order. A request that waits for memory holds the line (nothing behind it takes the pages it
        waits for, so it cannot starve) and holds no pin while it waits (so waiting requests cannot deadlock
        each other). A request whose adapter is still loading does not hold the line."""
        if not self._waiting:
            return
        queues: dict[str, deque[_Request]] = defaultdict(deque)
        for req in self._waiting:
            if not req.done:  # cancelled while waiting
                queues[req.job.tenant].append(req)
        heap = [(self._vtc[t], q[0].key, t) for t, q in queues.items()]
        heapq.heapify(heap)
        kept: list[_Request] = []
        running_seqs = sum(r.live for r in self._running)
        while heap:
            _, _, t = heapq.heappop(heap)
            req = queues[t].popleft()
            outcome = "full" if running_seqs + req.n > self.max_running else self._try_admit(req)
            if outcome in ("full", "blocked"):  # the line stops here: keep everything not yet admitted
                kept.append(req)
                for q in queues.values():
                    kept.extend(q)
                break
            if outcome == "loading":
                kept.append(req)
            elif outcome == "admitted":
                running_seqs += req.n
                self._vtc[t] += W_PROMPT * len(req.prompt_ids)  # the prompt is read once, whatever n
            if queues[t]:
                heapq.heappush(heap, (self._vtc[t], queues[t][0].key, t))
        kept.sort(key=lambda r: r.key)
        self._waiting = deque(kept)

    def _try_admit(self, req: _Request) -> str:
        """'admitted', 'failed', 'loading' (its adapter loads off-thread) or 'blocked' (waits for memory)."""
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
        need = self._blocks_needed(req)
        if self.allocator.num_free < need and self.cache is not None:
            self.cache.reclaim(need)  # idle adapters give their pages back to the KV cache
        if self.allocator.num_free < need:
            if req.ident is not None:  # wait unpinned: the adapter stays resident unless room is needed
                self._adapters.release(req.ident)
                req.slot, req.ident = -1, None
            self._wait_for_memory(req)
            return "blocked"
        blocks = self.allocator.allocate(need)
        shared, own = self._block_split(req)
        for seq in req.seqs:  # every table: the shared full prompt blocks, then blocks of its own
            seq.blocks = blocks[:shared] + blocks[shared + seq.index * own: shared + (seq.index + 1) * own]
        if shared and req.n > 1:
            self.allocator.share(blocks[:shared], req.n - 1)
            self.metrics.kv_blocks_shared += shared * (req.n - 1)
        self.metrics.sequences += req.n
        req.t_admit = time.perf_counter()
        self._running.append(req)
        return "admitted"

    @property
    def _adapters(self) -> AdapterCache:
        """The adapter cache. Only requests with an adapter reach it, and a LoRA-disabled engine (no cache)
        refuses those in _prepare."""
        return cast(AdapterCache, self.cache)

    def _wait_for_memory(self, req: _Request) -> None:
        if not req.waited_memory:
            req.waited_memory = True
            self.metrics.admissions_waited_memory += 1

    def _step(self) -> None:
        t0 = time.perf_counter()
        # Prefill budget goes to the tenant with the least service first (VTC), and within a tenant in
        # admission order, so an old long prompt is not starved by its own tenant's newer ones. Another tenant's
        # chunk rides in the same step only if it is no longer than what the least-served tenant reads in it:
        # on a CPU a step's time grows with its tokens, and the least-served tenant's first token must not wait
        # for a chunk of (say) a flood's queued prompts. Small prompts of several tenants still share a step;
        # decodes always ride. A deferred chunk waits one step per prompt of the tenant behind, never more: that
        # tenant is charged as it is served.
        budget = self.prefill_chunk
        lead: str | None = None  # the tenant first given prefill budget in this step
        lead_tokens = 0
        batch: list[tuple[_Request, _Seq | None, SeqStep]] = []  # seq None: a prefill chunk of the request
        for req in sorted(self._running, key=lambda r: (self._vtc[r.job.tenant], r.key)):
            start = req.prefilled
            left = len(req.prompt_ids) - start
            if left > 0:
                if budget <= 0:
                    continue
                n = min(left, budget)
                if lead is None:
                    lead = req.job.tenant
                if req.job.tenant == lead:
                    lead_tokens += n
                elif n > lead_tokens:
                    continue
                budget -= n
                batch.append((req, None, SeqStep(block_table=req.seqs[0].blocks, start_pos=start,
                                                 token_ids=req.prompt_ids[start: start + n], slot=req.slot)))
                continue
            for q in req.seqs:
                if not q.done:
                    batch.append((req, q, SeqStep(block_table=q.blocks, start_pos=q.num_computed,
                                                  token_ids=[q.out_ids[-1]], slot=req.slot)))
        batch.sort(key=lambda b: b[2].slot)  # stable: each adapter's tokens contiguous
        steps = [b[2] for b in batch]
        every = [i for i, (req, seq, _) in enumerate(batch) if seq is None and req.prompt_lps is not None]

        tf = time.perf_counter()
        logits, failed, prompt_logits = self._forward(steps, every)  # [len(steps), vocab]
        forward_s = time.perf_counter() - tf

        rows: list[int] = []  # logits row of each sequence that takes a token now
        seqs: list[_Seq] = []
        for i, (req, seq, step) in enumerate(batch):
            if req.done:
                continue
            if i in failed:
                self._fail(req, ErrorCode.INTERNAL_ERROR, f"the forward pass failed for this request: {failed[i]}")
                continue
            if seq is not None:
                seq.num_computed += 1
                rows.append(i)
                seqs.append(seq)
                continue
            n = len(step.token_ids)
            self.metrics.prefill_tokens += n
            try:
                if i in prompt_logits:
                    self._add_prompt_logprobs(req, step, prompt_logits[i])
            except Exception as exc:  # this request only
                log.exception("prompt logprobs of request %s failed", req.job.request_id)
                self._fail(req, ErrorCode.INTERNAL_ERROR, f"computing prompt logprobs failed: {exc!r}")
                continue
            req.prefilled += n
            if req.prefilled >= len(req.prompt_ids):  # the prompt is in: every sequence samples from this row
                self._fork(req)
                rows += [i] * req.live
                seqs += [q for q in req.seqs if not q.done]
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
        self._running = [r for r in self._running if not r.done]
        self.metrics.record_step(
            batch_size=len(steps), tokens=sum(len(s.token_ids) for s in steps),
            distinct_adapters=len({s.slot for s in steps}), forward_s=forward_s,
            step_s=time.perf_counter() - t0,
        )

    def _fork(self, req: _Request) -> None:
        """The prompt is in the first sequence's blocks: the others copy its partial last block into their own
        (the full blocks before it are already shared) and start at the same position."""
        self.metrics.prompt_prefills += 1
        first = req.seqs[0]
        full = len(req.prompt_ids) // self.block_size
        if len(req.seqs) > 1 and len(req.prompt_ids) % self.block_size:
            others = req.seqs[1:]
            self.runner.kv.copy_blocks([first.blocks[full]] * len(others), [q.blocks[full] for q in others])
            self.metrics.kv_blocks_copied += len(others)
        for seq in req.seqs:
            seq.num_computed = len(req.prompt_ids)
        if req.prompt_lps is not None:
            req.handle._publish_prompt(req.prompt_lps)

    def _add_prompt_logprobs(self, req: _Request, step: SeqStep, logits: torch.Tensor) -> None:
        """Logits at prompt positions start..start+n-1 predict prompt tokens start+1..start+n (the last of a
        final chunk predicts the first generated token: not a prompt token)."""
        start, ids, entries = step.start_pos, req.prompt_ids, req.prompt_lps
        m = min(len(step.token_ids), len(ids) - 1 - start)
        if m > 0 and entries is not None:
            entries += prompt_logprobs(logits[:m], ids[start + 1: start + 1 + m], req.job.prompt_logprobs or 0)

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
        self._vtc[req.job.tenant] += W_OUTPUT
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
        seq.done, seq.finish_reason = True, reason
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
        if scrub and held:  # a failed request may leave NaN/inf keys; padded gathers of later sequences read blocks
            self.runner.pool.data[:, sorted({b for blocks in held for b in blocks})] = 0
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
                seq.done, seq.finish_reason = True, reason
                if reason != "cancelled" and seq.text is not None:
                    seq.text.flush()
        req.live = 0
        self._release(req, scrub=error is not None and error[0] != ErrorCode.CANCELLED)
        if req.counted:  # it was waiting or running: its tenant has one request fewer in the engine
            req.counted = False
            self._active[req.job.tenant] -= 1
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
        ))

    def _fail(self, req: _Request, code: ErrorCode, message: str) -> None:
        self._finish(req, None, error=(code, message))
