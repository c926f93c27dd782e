"""Engine: the public API, method for method after `sglang.Engine`.

One background thread runs the scheduler; callers submit requests and wait on sinks. Control calls
(pause, abort, weight updates, memory release) take the same lock as a scheduler step, so they run
between steps, never inside one. Every input is validated in the caller's thread before anything is
queued: a bad request raises there and the engine keeps serving the others.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator

from tqdm.auto import tqdm

from rollout.engine_args import EngineArgs
from rollout.outputs import AsyncSink, SyncSink, build_output
from rollout.request import FinishReason, Req
from rollout.sampling_params import SamplingParams
from rollout.scheduler import Scheduler
from rollout.tokenizer import TokenizerWrapper
from rollout.weights_api import WeightsAPI
from runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Engine(WeightsAPI):
    def __init__(self, model_path: str | None = None, **kwargs) -> None:
        self.args = EngineArgs.from_kwargs(model_path, **kwargs)
        logging.getLogger("rollout").setLevel(self.args.log_level.upper())
        self.runner = ModelRunner(self.args.runner_config())
        self.tokenizer = TokenizerWrapper(self.args.model_path, self.args.skip_tokenizer_init)
        mc = self.runner.model_config
        self.eos_ids = self.tokenizer.eos_token_ids(mc.eos_token_ids, self.args.model_path)
        self.scheduler = Scheduler(self.runner, self.args.scheduler_config(), self.eos_ids, self.tokenizer.find_stop)
        self.weight_version = "default"
        self._num_updates = 0
        self._rng = random.Random(self.args.random_seed)
        self._cv = threading.Condition(threading.RLock())
        self._paused = False
        self._shutdown = False
        self._reqs: dict[str, Req] = {}
        self._finished_rids: dict[str, None] = {}  # recent ones, insertion-ordered, bounded
        self._thread = threading.Thread(target=self._loop, name="rollout-scheduler", daemon=True)
        self._thread.start()

    # ---- lifecycle ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._cv:
            if self._shutdown:
                return
            self._shutdown = True
            for req in list(self._reqs.values()):
                req.finished_reason = FinishReason("abort", message="engine shut down")
                req.sink.put(("final", req))
            self._cv.notify_all()
        self._thread.join(timeout=30)
        self.runner.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- the scheduler thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._shutdown and (self._paused or not self.scheduler.has_work()
                                              or not self._memory_resident()):
                    self._cv.wait()
                if self._shutdown:
                    return
                try:
                    updated = self.scheduler.step()
                except Exception as e:  # keep serving: fail what was in flight, with the reason
                    logger.exception("scheduler step failed")
                    self._fail_all(f"{type(e).__name__}: {e}")
                    continue
                for req in updated:
                    if req.finished:
                        self._reqs.pop(req.rid, None)
                        self._remember_finished(req.rid)
                        req.weight_version = self.weight_version
                        req.sink.put(("final", req))
                    elif req.stream:
                        # A copy: the reader builds the chunk later, while this thread keeps appending.
                        req.sink.put(("chunk", req.snapshot()))

    def _memory_resident(self) -> bool:
        """Requests wait (rather than fail) while weights or KV cache are released."""
        saver = self.runner.memory_saver
        return saver.is_resident("weights") and saver.is_resident("kv_cache")

    def _remember_finished(self, rid: str) -> None:
        self._finished_rids[rid] = None
        if len(self._finished_rids) > 100_000:
            self._finished_rids.pop(next(iter(self._finished_rids)))

    def _fail_all(self, message: str) -> None:
        """A step raised: finish every in-flight request with the reason and start from clean pools.

        The failed step may have admitted requests half-way (a row, some KV slots), so rather than
        unwinding each one the scheduler's bookkeeping is reset wholesale; nothing else is running.
        """
        for req in list(self._reqs.values()):
            req.finished_reason = FinishReason("abort", message=message)
            req.error = message
            req.sink.put(("final", req))
        self._reqs.clear()
        self.scheduler.reset()

    # ---- requests ----------------------------------------------------------------------------
    def _make_reqs(self, prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, rid, stream):
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else prompt
            if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a list of strings")
            ids_list = [self.tokenizer.encode(p) for p in prompts]
        else:
            single = bool(input_ids) and all(isinstance(t, int) for t in input_ids)
            ids_list = [input_ids] if single else input_ids
            if not isinstance(ids_list, list) or not all(
                isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
                for ids in ids_list
            ):
                raise ValueError("input_ids must be a list of ints or a list of lists of ints")
        if not ids_list:
            raise ValueError("empty batch: no prompts given")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(ids_list)} prompts")
            sps = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            sp = SamplingParams.from_dict(sampling_params)
            sps = [sp] * len(ids_list)
        if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be an int >= 0, got {top_logprobs_num!r}")
        rids = rid if isinstance(rid, list) else [rid] * len(ids_list)
        if len(rids) != len(ids_list):
            raise ValueError(f"rid has {len(rids)} entries for {len(ids_list)} prompts")
        vocab, ctx = self.runner.model_config.vocab_size, self.runner.context_len
        reqs = []
        for i, (ids, sp) in enumerate(zip(ids_list, sps)):
            sp.verify(vocab)
            if sp.stop and self.tokenizer.tokenizer is None:  # else they would silently never match
                raise ValueError("sampling param stop needs a tokenizer (stop strings are matched on text); this "
                                 "engine has none: use stop_token_ids")
            if not ids:
                raise ValueError(f"prompt {i} is empty (input_ids needs at least one token)")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"input_ids of prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")
            if len(ids) >= ctx:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; the context length is {ctx} "
                                 f"(prompt must leave room for at least one new token)")
            base_seed = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
            for j in range(sp.n):
                req_rid = (rids[i] if sp.n == 1 else f"{rids[i]}-{j}") if rids[i] else uuid.uuid4().hex
                # n samples of one seeded request differ from each other but are reproducible.
                seed = base_seed if j == 0 else hash((base_seed, j)) & ((1 << 63) - 1)
                reqs.append(Req(req_rid, list(ids), sp, seed, return_logprob, top_logprobs_num, stream,
                                index=len(reqs)))
        if stream and len(reqs) != 1:
            raise ValueError("stream=True takes a single prompt with n=1")
        return reqs, single and sps[0].n == 1

    def _submit(self, reqs: list[Req], sink) -> None:
        with self._cv:
            if self._shutdown:
                raise RuntimeError("engine is shut down")
            if not self.runner.weights_valid:
                raise RuntimeError(self.runner.invalid_weights_message())
            if not self.runner.memory_saver.is_resident("weights") or not self.runner.memory_saver.is_resident(
                    "kv_cache"):
                raise RuntimeError("memory is released: call resume_memory_occupation() before generate")
            dup = [r.rid for r in reqs if r.rid in self._reqs]
            if dup or len({r.rid for r in reqs}) != len(reqs):
                raise ValueError(f"request id(s) already in flight: {dup or 'duplicates in this call'}")
            for req in reqs:
                req.sink = sink
                self._reqs[req.rid] = req
                self.scheduler.add_request(req)
            self._cv.notify_all()

    def _output(self, req: Req, final: bool) -> dict:
        return build_output(req, self.tokenizer, req.weight_version if final else self.weight_version, final)

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob: bool = False,
                 top_logprobs_num: int = 0, stream: bool = False, rid=None, show_progress: bool | None = None,
                 **unsupported):
        """Blocking generation. One dict for a single prompt with n=1, else a list (n dicts per prompt)."""
        if unsupported:
            raise TypeError(f"generate got unsupported argument(s) {sorted(unsupported)}")
        reqs, single = self._make_reqs(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                       rid, stream)
        sink = SyncSink()
        self._submit(reqs, sink)
        if stream:
            return self._stream(reqs[0], sink)
        show = self.args.show_progress if show_progress is None else show_progress
        results: list[dict | None] = [None] * len(reqs)
        t0 = time.perf_counter()
        with tqdm(total=len(reqs), disable=not show or len(reqs) < 2, desc="generate", unit="req") as bar:
            for _ in range(len(reqs)):
                _, req = sink.get()
                results[req.index] = self._output(req, final=True)
                bar.update(1)
        self.last_call_seconds = time.perf_counter() - t0
        return results[0] if single else results

    def _stream(self, req: Req, sink: SyncSink) -> Iterator[dict]:
        done = False
        try:
            while not done:
                kind, r = sink.get()
                done = kind == "final"
                yield self._output(r, final=done)
        finally:
            if not done:  # the caller closed or dropped the stream: stop spending compute on it
                self._abort_quietly([req])

    def _abort_quietly(self, reqs: list[Req]) -> None:
        with self._cv:
            for req in reqs:
                if req.rid in self._reqs and self.scheduler.abort(req.rid) is not None:
                    self._reqs.pop(req.rid, None)
                    self._remember_finished(req.rid)

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None,
                             return_logprob: bool = False, top_logprobs_num: int = 0, stream: bool = False,
                             rid=None):
        """asyncio twin of generate: many coroutines share the engine, each awaiting its own results."""
        reqs, single = self._make_reqs(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                       rid, stream)
        sink = AsyncSink(asyncio.get_running_loop())
        self._submit(reqs, sink)
        if stream:
            return self._astream(reqs[0], sink)
        results: list[dict | None] = [None] * len(reqs)
        try:
            for _ in range(len(reqs)):
                _, req = await sink.get()
                results[req.index] = self._output(req, final=True)
        except asyncio.CancelledError:  # a cancelled caller's requests stop generating
            self._abort_quietly(reqs)
            raise
        return results[0] if single else results

    async def _astream(self, req: Req, sink: AsyncSink) -> AsyncIterator[dict]:
        done = False
        try:
            while not done:
                kind, r = await sink.get()
                done = kind == "final"
                yield self._output(r, final=done)
        finally:
            if not done:
                self._abort_quietly([req])

    # ---- control -----------------------------------------------------------------------------
    def abort_request(self, rid: str) -> bool:
        """Abort a request in flight (it finishes with finish_reason "abort"). Returns False for one
        that already finished (a benign race at the end of a rollout); an id never seen is an error."""
        with self._cv:
            req = self.scheduler.abort(rid)
            if req is None:
                if rid in self._finished_rids:
                    return False
                raise ValueError(f"abort_request: unknown request id {rid!r} (never submitted to this engine)")
            self._reqs.pop(rid, None)
            self._remember_finished(rid)
            req.weight_version = self.weight_version
            req.sink.put(("final", req))
            return True

    def pause_generation(self) -> None:
        with self._cv:
            self._paused = True

    def continue_generation(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def flush_cache(self) -> bool:
        with self._cv:
            self.scheduler.flush_cache()
            return True

    def get_server_info(self) -> dict:
        with self._cv:
            s = dict(self.scheduler.stats)
            total = s["num_prompt_tokens"]
            s["cache_hit_rate"] = s["num_cached_tokens"] / total if total else 0.0
            s.update(weight_version=self.weight_version, num_in_flight=self.scheduler.num_in_flight(),
                     max_total_num_tokens=self.runner.max_total_num_tokens, context_length=self.runner.context_len,
                     paused=self._paused,
                     memory_bytes={t: self.runner.memory_saver.bytes_held(t) for t in ("weights", "kv_cache",
                                                                                         "cuda_graph")})
            return s
