"""The overlap schedule: while decode step N runs its forward, the scheduler builds step N+1.

As SGLang's overlap scheduler (and the seed's `forward_stream`): the forward and sampling of a decode
step run on a ForwardWorker (its own thread on the CPU; on CUDA that thread also runs on its own
stream), and the scheduler thread meanwhile builds the next decode step and launches it behind the
first, with step N's sampled ids filled in on the worker (an index_select of N's output, never a host
read). Then it processes step N's tokens (stop checks, delivery) while step N+1 runs.

What a step launched ahead may contain, so that outputs equal those of the plain schedule:
- only decode steps are launched ahead, and only when the plain schedule would decode next too (no
  half-prefilled prompt, nothing waiting that could be admitted), with KV slots free without eviction,
  and no penalties (they need the tokens of step N on the host);
- its rows are step N's rows minus requests that step N finishes for sure (their length limit); a row
  that step N finishes otherwise (a stop token or string) still runs in N+1 and its token is dropped;
  its KV is released only once N+1 is done (`DecodeAhead.deferred`), since N+1 still reads it;
- sampling is counter-based per request, so the row of a request gives the same token in any batch;
  N+1 samples at output position len(output_ids) + 1.
Anything that must see a step boundary (every control call, any scheduler mutation: abort, retract,
flush, reset) first calls `cancel()`: the step launched ahead is waited for and rolled back (its slots
freed, its tokens dropped), so the state is exactly the plain schedule's after step N.

Prefill steps are not overlapped (the pipeline is empty then); on the CPU they too run on the worker,
the scheduler thread waiting, so one thread steps the model and holds the one OpenMP pool
(runner/openmp_pool.py). A step that raises on the worker is re-run with the plain schedule's failure
attribution.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from rollout.batch import decode_batch
from rollout.request import Req
from rollout.thread_pinning import OverlapPinning
from runner.openmp_pool import release_thread_pool

logger = logging.getLogger(__name__)

IDLE_RELEASE_S = 0.05  # a worker idle this long frees its OpenMP pool; a busy pipeline never waits that long


_STOP = object()  # queued by ForwardWorker.close


class Phased(NamedTuple):
    """A job in two parts. The worker runs `prologue`, then hands over the previous job's result, then runs
    `body`, whose value is this job's result. A decode step puts its own Python (filling its input ids from
    the step before) in the prologue and the forward in the body: the scheduler
    thread, woken by the previous step's result, then runs its host work while this thread is inside the
    forward's C++ op (which releases the GIL), instead of contending with this thread's Python for the GIL
    (on a 2-core CPU that contention had made the overlap schedule slower than the plain one)."""

    prologue: Callable[[], None]
    body: Callable[[], object]


class ForwardWorker:
    """One thread that runs submitted functions (or Phased jobs) in submission order (on CUDA: on its own
    stream, after the work the submitting thread had queued on its stream). A job's result is handed over
    when the next job reaches its body, or at once when nothing is queued behind it."""

    def __init__(self, device, on_start=None) -> None:
        self.device = torch.device(device)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stream = None
        if self.device.type == "cuda":  # imported lazily: never touched on the CPU path
            self._stream = torch.cuda.Stream(self.device)
        self._on_start = on_start
        self._thread = threading.Thread(target=self._run, name="rollout-forward", daemon=True)
        self._thread.start()

    def submit(self, fn) -> Future:
        fut: Future = Future()
        event = None
        if self._stream is not None:
            # The batch's host->device copies were queued on the caller's stream: the forward waits for them.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._jobs.put((fn, fut, event))
        return fut

    def is_current_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        if self._stream is not None and self.device.index is not None:  # the current device is per thread
            torch.cuda.set_device(self.device)
        if self._on_start is not None:
            self._on_start()
        held = None  # (future, value, error) of the last job: handed over once the next one reaches its body
        while True:
            job = None
            if held is not None:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:  # nothing queued behind it: hand it over now
                    self._hand_over(held)
                    held = None
            if job is None:
                try:
                    job = self._jobs.get(timeout=IDLE_RELEASE_S)
                except queue.Empty:
                    # Idle for a while (not merely between two steps): give back this thread's OpenMP pool, so
                    # the process's other threads run at full speed meanwhile (runner/openmp_pool.py).
                    release_thread_pool()
                    job = self._jobs.get()
            if job is _STOP:
                if held is not None:
                    self._hand_over(held)
                return
            fn, fut, event = job
            value = error = None
            with contextlib.nullcontext() if self._stream is None else torch.cuda.stream(self._stream):
                if event is not None:
                    self._stream.wait_event(event)
                if isinstance(fn, Phased):
                    try:
                        fn.prologue()
                    except BaseException as e:  # the scheduler thread handles it where it waits
                        error = e
                # The previous job's result goes out only now, right before this one's body: the thread
                # waiting for it then does its Python while this thread is inside the forward's op,
                # which releases the GIL, not while both need the GIL (see Phased).
                if held is not None:
                    self._hand_over(held)
                    held = None
                if error is None:
                    try:
                        value = fn.body() if isinstance(fn, Phased) else fn()
                    except BaseException as e:
                        error = e
            held = (fut, value, error)
            # Hold nothing of a finished job while idle: its closure references requests (and their sinks).
            del job, fn, fut, event, value, error

    @staticmethod
    def _hand_over(held) -> None:
        fut, value, error = held
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)

    def close(self, timeout: float = 30) -> None:
        self._jobs.put(_STOP)
        self._thread.join(timeout)


@dataclass(eq=False)
class DecodeAhead:
    """A decode step on the worker whose results the scheduler has not processed yet."""

    reqs: list[Req]  # its rows, in order
    locs: torch.Tensor  # [bs] the KV slots it writes, as the pool returned them
    future: Future  # -> (next_token_ids [bs] on the device, list of per-row host results)
    members: set[int] = field(default_factory=set)  # id() of its reqs
    deferred: list[Req] = field(default_factory=list)  # finished meanwhile; their KV is freed after this step
    out: dict = field(default_factory=dict)  # "ids": its sampled ids, once the worker has run it


class OverlapDecoder:
    """Runs the scheduler's decode steps on a ForwardWorker, one launched ahead of the next."""

    def __init__(self, scheduler, pinning: OverlapPinning | None = None) -> None:
        self.s = scheduler
        self.pinning = pinning or OverlapPinning(False)  # the scheduler thread pins itself at its first step

        def on_start():
            scheduler._set_step_threads()
            self.pinning.pin_worker(torch.get_num_threads())

        self.worker = ForwardWorker(scheduler.runner.device, on_start=on_start)
        self.ahead: DecodeAhead | None = None  # launched, not yet processed
        # Set by the engine: True while something (a control call, a new request) waits to act at the
        # next step boundary; nothing is launched ahead then, so it waits for one step at most.
        self.hold_back = lambda: False

    # ---- the scheduler's entry points ------------------------------------------------------------
    def run_decode(self, reqs: list[Req], locs: torch.Tensor) -> list[Req]:
        """Run the decode step the plain schedule built (`reqs`, KV slots `locs` allocated), launching the
        one after it ahead where allowed. Returns the requests that got a token or finished."""
        self.ahead = self._launch(reqs, locs, prev=None)
        return self.advance()

    def advance(self) -> list[Req]:
        """Launch the step after the one in flight (where allowed), then process the one in flight."""
        step, self.ahead = self.ahead, None
        self.ahead = self._launch_next(step)
        return self._complete(step)

    def defer_release(self, req: Req) -> bool:
        """req just finished: if the step in flight reads its KV, free it after that step (True)."""
        if self.ahead is not None and id(req) in self.ahead.members:
            self.ahead.deferred.append(req)
            return True
        return False

    def cancel(self) -> None:
        """Roll back the step launched ahead: wait for it, drop its tokens, free its slots."""
        step, self.ahead = self.ahead, None
        if step is None:
            return
        try:
            step.future.result()
        except Exception:  # its failure does not matter: it is dropped
            pass
        for req in step.reqs:
            req.num_allocated -= 1  # the slot it was given for this step
        self.s.kv.kv_pool.free(step.locs.to("cpu"))
        self.s.stats["num_decode_steps"] -= 1
        self.s.stats["num_overlapped_steps"] -= 1
        for req in step.deferred:
            self.s.kv.release(req)

    def close(self) -> None:
        self.cancel()
        self.worker.close()
        self.pinning.release()

    # ---- launching -------------------------------------------------------------------------------
    def _launch(self, reqs: list[Req], locs: torch.Tensor, prev: DecodeAhead | None,
                src: list[int] | None = None) -> DecodeAhead:
        """Queue the decode of `reqs` on the worker. With `prev`, each row's input token is row src[i] of
        prev's sampled ids (prev still in flight), and every position is one further on."""
        s, device = self.s, self.s.runner.device
        pending = 0 if prev is None else 1
        fb = decode_batch(reqs, locs.to(device), device, pending=pending)
        fb.sampling_info = s._sampling_info(reqs, step_offset=pending)
        # The fused forward's arguments, made here while step N runs (they read fb.input_ids when the step
        # runs, after the job fills it): the worker's own Python per step is then a few calls, and this
        # thread's host work runs while the worker is inside the op, which releases the GIL.
        prepare = getattr(s.runner, "prepare_forward", None)
        prepared = None if prepare is None else prepare(fb)
        s.stats["num_decode_steps"] += 1

        # This step's KV slots go into the request table now, from this thread: step N (in flight) reads
        # each row only up to its own length, and this step's slot sits one past it. The worker's stream
        # (CUDA) waits for this thread's work queued before submit.
        s.kv.write_decode(fb.req_pool_indices, fb.positions, fb.out_cache_loc)
        # On the CPU the results are read back on the scheduler thread (_complete), off the worker's
        # critical path; on CUDA the worker reads them on the stream that computed them.
        rows_on_worker = device.type != "cpu"
        # Rows of step N this step continues; None when it continues every row (the common case: a copy).
        src_t = None
        if prev is not None and src != list(range(len(prev.reqs))):
            src_t = torch.tensor(src, dtype=torch.int64, device=device)

        out: dict = {}  # "ids": this step's sampled ids on the device, read by the step launched behind it

        def prologue():
            if prev is not None and "ids" not in prev.out:
                raise RuntimeError("the decode step this one continues failed")

        def body():
            # Step N ran before this on the worker: its sampled ids are this step's input, filled in by
            # the same call that runs the forward where it can (one GIL hand-back per step).
            fill = None if prev is None else (prev.out["ids"], src_t)
            sample_out, _ = s._forward_sample_device(fb, reqs, prepared=prepared, fill=fill)
            out["ids"] = sample_out.next_token_ids
            return s._host_rows(sample_out, reqs) if rows_on_worker else sample_out

        return DecodeAhead(list(reqs), locs, self.worker.submit(Phased(prologue, body)), {id(r) for r in reqs},
                           out=out)

    def _launch_next(self, step: DecodeAhead) -> DecodeAhead | None:
        s = self.s
        if self.hold_back() or s.chunked_req is not None:
            return None
        if s.waiting and len(s.running) < s.max_running and s.kv.num_free_rows():
            return None  # the plain schedule might admit a waiting request next: let it
        ctx = s.runner.context_len
        rows, src = [], []
        for i, req in enumerate(step.reqs):
            if req.finished:
                continue
            sp = req.sampling_params
            if sp.repetition_penalty != 1 or sp.frequency_penalty or sp.presence_penalty:
                return None  # the penalty counts need step N's tokens on the host
            if (sp.max_new_tokens is not None and len(req.output_ids) + 1 >= sp.max_new_tokens) \
                    or req.seq_len + 1 >= ctx:
                continue  # step N's token finishes it for sure
            rows.append(req)
            src.append(i)
        if not rows or s.kv.kv_pool.available_size() < len(rows):
            return None  # nothing to run ahead, or it would evict cache entries the plain schedule keeps
        locs = s.kv.alloc_decode(rows, pending=1)
        s.stats["num_overlapped_steps"] += 1
        return self._launch(rows, locs, prev=step, src=src)

    # ---- completing -------------------------------------------------------------------------------
    def _complete(self, step: DecodeAhead) -> list[Req]:
        s = self.s
        try:
            results = step.future.result()
            if not isinstance(results, list):  # read back here, off the worker (see _launch)
                results = s._host_rows(results, step.reqs)
        except Exception:
            # Re-run it on this thread with the plain schedule's attribution; what was launched behind it
            # read its ids, so it goes first.
            self.cancel()
            updated = self._rerun(step)
        else:
            updated = []
            for req, res in zip(step.reqs, results):
                if req.finished:  # finished by the step before: this row only kept its KV alive
                    continue
                try:
                    req.num_computed = req.seq_len
                    s._append_token(req, res)
                except Exception as e:  # this request's own host work: it fails alone
                    s._fail(req, f"{type(e).__name__}: {e}")
                updated.append(req)
        for req in step.deferred:
            s.kv.release(req)
        return updated

    def _rerun(self, step: DecodeAhead) -> list[Req]:
        """The step raised on the worker: run its live rows again here, splitting to find the culprits."""
        s, device = self.s, self.s.runner.device
        units = [(r, i) for i, r in enumerate(step.reqs) if not r.finished]
        locs = step.locs.to(device)

        def run(sub):
            batch = [r for r, _ in sub]
            idx = torch.tensor([i for _, i in sub], dtype=torch.int64, device=device)
            fb = decode_batch(batch, locs.index_select(0, idx), device)
            s.kv.write_decode(fb.req_pool_indices, fb.positions, fb.out_cache_loc)
            return s._forward_sample(fb, batch)

        return s._process_decode(s._run_attributed(units, run))
