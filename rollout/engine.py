"""Engine: the public API, method for method after `sglang.Engine`.

One background thread runs the scheduler (rollout.scheduler_loop); callers submit requests and wait on
sinks. Submitting never waits for a step: requests go into a queue the scheduler thread takes at every
step boundary (so an asyncio caller never blocks its event loop on the engine). Control calls (pause,
abort, weight updates, memory release, server info) enter the step lock through rollout.step_gate,
which makes the scheduler thread stop at the next step boundary and roll back a step it launched ahead
(rollout.overlap): they act between two steps, whatever the size of the batch, after waiting for the
step in progress at most. `get_load()` reads counters the scheduler publishes after every step, and
takes no lock. Every input is validated in the caller's thread
before anything is queued: a bad request raises there and the engine keeps serving the others. Every
output leaves through one path, `_deliver`, which no caller can make raise: a consumer that is gone
(closed event loop, dropped stream) has its requests aborted and their KV freed.

Control semantics are SGLang's: abort_request(rid, abort_all) (an unknown or finished id is a no-op),
pause_generation(mode="abort" | "retract" | "in_place") / continue_generation(), flush_cache() -> FlushCacheReqOutput.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import threading
import time
from collections import deque

from tqdm.auto import tqdm

from rollout.engine_args import EngineArgs
from rollout.engine_info_api import EngineInfoAPI
from rollout.lora_api import LoRAAPI
from rollout.outputs import AsyncSink, AsyncStream, SyncSink, SyncStream, build_output, gather_final_outputs
from rollout.pause_watchdog import PauseWatchdog, timeout_from_env
from rollout.profiler import ProfilerAPI, StepProfiler
from rollout.request import FinishReason, Req
from rollout.rids import new_rid
from rollout.sampling_params import SamplingParams, is_integer
from rollout.scheduler import Scheduler
from rollout.scheduler_loop import run_scheduler_loop
from rollout.score_api import ScoreAPI
from rollout.sglang_generate_args import check_generate_args
from rollout.step_gate import StepGate
from rollout.tokenizer import TokenizerWrapper
from rollout.weight_checker_api import WeightCheckerAPI
from rollout.weights_api import WeightsAPI
from runner.openmp_pool import release_thread_pool
from runner.tp import create_model_runner

logger = logging.getLogger(__name__)
_NO_DEFAULT = object()  # _per_prompt: None is refused like any other wrong value

PAUSE_MODES = ("abort", "retract", "in_place")
# Sequences (prompts x n) one generate call may ask for: far above an RL step's batch (1024 prompts x 64 samples
# is 65,536), far below what one Req each would cost in host memory to build before anything else is checked.
MAX_SEQUENCES_PER_CALL = 1 << 20




def prompt_token_ids(tokenizer: TokenizerWrapper, prompt, input_ids) -> tuple[list[list[int]], bool]:
    """generate's prompt arguments, validated -> (token ids per prompt, whether it was a single prompt).
    Text is encoded with `tokenizer`; input_ids are checked, not copied. Given both, input_ids are the prompt
    and the text is not read, as in SGLang (its tokenizer manager takes input_ids first)."""
    if prompt is None and input_ids is None:
        raise ValueError("pass prompt or input_ids")
    if input_ids is not None:
        prompt = None
    if prompt is not None:
        single = isinstance(prompt, str)
        prompts = [prompt] if single else prompt
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompt must be a string or a list of strings")
        return [tokenizer.encode(p) for p in prompts], single
    ids_list, single = _ids_lists(input_ids)
    if ids_list is None:  # not plain ints: numpy / torch integers are read as ints (a copy), anything else refused
        ids_list, single = _ids_lists(_plain_ints(input_ids))
    if ids_list is None:
        got = "" if isinstance(input_ids, list) else f", got {type(input_ids).__name__}"
        raise ValueError(f"input_ids must be a list of ints or a list of lists of ints (numpy or torch integers "
                         f"too){got}")
    return ids_list, single


def _ids_lists(input_ids) -> tuple[list[list[int]] | None, bool]:
    """(token ids per prompt, single prompt) if input_ids is a list of ints or of lists of ints, else (None, _)."""
    # isinstance first: a tensor or an array has no truth value (its own "ambiguous" error, naming nothing)
    single = isinstance(input_ids, list) and bool(input_ids) and all(isinstance(t, int) for t in input_ids)
    ids_list = [input_ids] if single else input_ids
    if not isinstance(ids_list, list) or not all(
        isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        for ids in ids_list
    ):
        return None, single
    return ids_list, single


def _plain_ints(x):
    """numpy / torch integer arrays and scalars (verl's prompt_token_ids) as Python ints, nested lists kept;
    anything else (floats, bools, strings) left as it is, for the check to refuse."""
    if isinstance(x, list):
        return [_plain_ints(v) for v in x]
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "tolist"):
        return x
    kind = getattr(dtype, "kind", None)  # numpy: "i"/"u" integers, "b" bool
    is_int = kind in ("i", "u") if kind is not None else (not getattr(dtype, "is_floating_point", True)
                                                           and not getattr(dtype, "is_complex", True)
                                                           and str(dtype) != "torch.bool")
    return x.tolist() if is_int else x




WAITING_ABORT_MESSAGE = "Abort in waiting queue"  # abort_request's message for requests not running (SGLang's)


def sample_seed(base_seed: int, j: int) -> int:
    """The seed of sample j of a request seeded `base_seed`: the n samples differ from each other but are
    reproducible, and sample 0 is the n=1 request (a caller that splits n into n=1 requests uses this too)."""
    return base_seed if j == 0 else hash((base_seed, j)) & ((1 << 63) - 1)


class Engine(WeightsAPI, WeightCheckerAPI, LoRAAPI, ProfilerAPI, EngineInfoAPI, ScoreAPI):
    def __init__(self, model_path: str | None = None, **kwargs) -> None:
        self.args = EngineArgs.from_kwargs(model_path, **kwargs)
        pause_timeout_s = timeout_from_env()  # before anything is built: a bad value leaks nothing
        logging.getLogger("rollout").setLevel(self.args.log_level.upper())
        self.runner = create_model_runner(self.args.runner_config())
        self.tokenizer = TokenizerWrapper(self.args.tokenizer_path or self.args.model_path, self.args.skip_tokenizer_init)
        # The checkpoint being served: the launch path until an update_weights_from_disk succeeds.
        self.model_path = self.tokenizer_path = self.args.model_path
        mc = self.runner.model_config
        self.eos_ids = self.tokenizer.eos_token_ids(mc.eos_token_ids, self.args.model_path)
        self.scheduler = Scheduler(self.runner, self.args.scheduler_config(), self.eos_ids, self.tokenizer.find_stop)
        self._num_updates = 0
        self._weights_generation = 0  # +1 on every weight change (the labels may repeat; this never does)
        self._set_weight_version(getattr(self.args, "weight_version", "default"))  # until the first update
        # Unseeded requests' seeds: from random_seed, or (None, the default) from the OS, as SGLang draws one.
        self._rng = random.Random(self.args.random_seed)
        self._cv = StepGate()  # the step lock; `with self._cv:` is a control call (see rollout.step_gate)
        # SGLANG_ENGINE_PAUSE_TIMEOUT: a pause left alone that long ends by itself (rollout/pause_watchdog.py).
        self._pause_watchdog = PauseWatchdog(pause_timeout_s, self._continue_after_timeout)
        self._paused = False
        self._shutdown = False
        # In flight, by rid (submitted and not yet delivered final). _reqs_lock guards it and the inbox; it
        # is only ever held for a few dict operations, never during a step.
        self._reqs: dict[str, Req] = {}
        self._reqs_lock = threading.Lock()
        self._inbox: deque[Req] = deque()  # submitted, not yet handed to the scheduler
        self._posted_aborts: deque[tuple[list[Req], str]] = deque()  # aborts that nobody waits for
        self._load = {"num_running": 0, "num_waiting": 0, "num_used_tokens": 0}
        self._lora_unloading: set[int] = set()  # LoRA adapter uids waiting for their requests to unload
        # start_profile / stop_profile: driven by the scheduler thread, run where the forwards run.
        overlap = self.scheduler.overlap
        self._profiler = StepProfiler(None if overlap is None else lambda fn: overlap.worker.submit(fn).result(),
                                      step_ranges=overlap is None)
        if self.scheduler.overlap is not None:
            self.scheduler.overlap.hold_back = self._hold_back
        # No decode block starts while something waits to act, or while a profile counts steps.
        self.scheduler.hold_back = lambda: self._hold_back() or self._profiler.busy
        self._cv.on_pending = self.scheduler.interrupt_block  # ... and one in progress stops at its next step
        self._cv.on_acquire = self._at_step_boundary
        self._cv.on_release = self._after_control
        self._finish_observers: list = []  # fn(req) per finished request (the server's latency metrics)
        # Called at every step boundary (after a step's deliveries, and at the end of every control call),
        # holding the step lock: a sink that batches what a step delivered sends it then, as one message
        # (rollout/server/engine_process.py). It must be quick and must not raise.
        self.on_step_boundary = None
        self._thread = threading.Thread(target=run_scheduler_loop, args=(self,), name="rollout-scheduler",
                                        daemon=True)
        self._thread.start()
        release_thread_pool()  # the pool that built the model would slow the scheduler thread's steps

    # ---- lifecycle ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._pause_watchdog.disarm()
        with self._cv:
            with self._reqs_lock:  # no submission gets in after this
                if self._shutdown:
                    return
                self._shutdown = True
            self._take_submissions()
            self._abort_reqs(self._in_flight(), "engine shut down")
            self._cv.notify_all()
        self._thread.join(timeout=30)
        if self._thread.is_alive():  # a step is still running: freeing its tensors under it would crash
            logger.error("the scheduler thread did not stop within 30 s; the engine's memory is not freed")
            return
        self.scheduler.close()
        self._weight_snapshot = None  # check_weights('snapshot')'s host copy
        self.runner.shutdown()  # frees every tensor, even while this Engine is still referenced

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- what the scheduler thread calls (rollout.scheduler_loop), always under self._cv ---------
    def _in_flight(self) -> list[Req]:
        with self._reqs_lock:
            return list(self._reqs.values())

    def _at_step_boundary(self) -> None:
        """What every control call does first, holding the step lock: roll back a step launched ahead,
        and give the scheduler every request submitted so far (so the call sees them)."""
        self.scheduler.cancel_ahead()
        self._take_submissions()

    def _take_submissions(self) -> None:
        """Hand queued submissions to the scheduler and run posted aborts (step lock held)."""
        while True:
            with self._reqs_lock:
                if not self._inbox:
                    break
                req = self._inbox.popleft()
            if not req.finished:  # aborted while queued: it was delivered already
                self.scheduler.add_request(req)
        while self._posted_aborts:
            reqs, message = self._posted_aborts.popleft()
            self._abort_reqs(reqs, message)

    def _hold_back(self) -> bool:
        """Something waits for the next step boundary: the overlap schedule launches nothing ahead."""
        return self._cv.pending or bool(self._inbox) or bool(self._posted_aborts) or self._shutdown

    def _after_control(self) -> None:
        """The end of every control call, on the caller's thread: publish the counters, and free the
        OpenMP pool the call's tensor work may have built there (runner/openmp_pool.py)."""
        self._publish_load()
        release_thread_pool()

    def _publish_load(self) -> None:
        """Counters for get_load(), read without the lock (one dict swap, atomic for readers)."""
        s = self.scheduler
        # As SGLang: slots the prefix cache could evict count as free, so an idle engine reads 0 however warm
        # its cache (slime waits for num_used_tokens == 0 after abort_all).
        self._load = {"num_running": len(s.running) + (s.chunked_req is not None), "num_waiting": len(s.waiting),
                      "num_used_tokens": max(0, self.runner.max_total_num_tokens - s.kv.available_tokens())}
        if self.on_step_boundary is not None:
            self.on_step_boundary()

    def get_load(self) -> dict:
        """SGLang's load report, without waiting for the step in progress: {"num_reqs", "num_waiting_reqs",
        "num_tokens"} as of the last step boundary (submissions not yet scheduled count as waiting)."""
        load, queued = self._load, len(self._inbox)
        return {"num_reqs": load["num_running"] + load["num_waiting"] + queued,
                "num_waiting_reqs": load["num_waiting"] + queued, "num_tokens": load["num_used_tokens"]}

    def _can_step(self) -> bool:
        # Paused requests wait while weights or KV cache are released (a continue before the resume ends them:
        # _continue).
        saver = self.runner.memory_saver
        return (not self._paused and self.scheduler.has_work() and saver.is_resident("weights")
                and saver.is_resident("kv_cache"))

    def _deliver(self, req: Req) -> None:
        """The one path by which outputs leave the scheduler: a stream chunk, or the final output (then
        the request leaves the engine). Never raises: a consumer that is gone drops its requests."""
        if req.finished:
            with self._reqs_lock:
                if self._reqs.get(req.rid) is not req:
                    return  # delivered already
                del self._reqs[req.rid]
            req.weight_version = self.weight_version
            req.finished_time = time.perf_counter()
            self._notify_finished(req)
            item = ("final", req)
        elif req.stream:
            interval = req.sampling_params.stream_interval or self.args.stream_interval
            num_out = len(req.output_ids)
            if interval > 1 and (num_out - 1) // interval == (req.stream_sent_len - 1) // interval:
                # SGLang's stream_interval: tokens 1, N+1, 2N+1, ... (and the final output) go out; a decode
                # block's tokens arrive together, so a chunk goes once a block has passed one of those points.
                return
            if req.stop_prefix_pending:
                return  # the text may end in a stop match the final output cuts: never send it to take back
            req.stream_sent_len = num_out
            # A copy: the reader builds the chunk later, while the scheduler keeps appending. A sink that
            # reads the request at once, under the step lock (rollout/server/engine_process.py), needs none.
            item = ("chunk", req if getattr(req.sink, "reads_at_put", False) else req.snapshot())
        else:
            return
        try:
            req.sink.put(item)
        except Exception as e:  # closed loop, closed stream, anything: that consumer only
            self._drop_consumer(req.sink, f"{type(e).__name__}: {e}")

    def _notify_finished(self, req: Req) -> None:
        for fn in self._finish_observers:
            try:
                fn(req)
            except Exception:  # an observer's bug must not lose the output
                logger.exception("finish observer %r failed", fn)

    # Copy-on-write, no engine lock: the server adds/removes from its event loop, which must never wait
    # for a step; the scheduler thread iterates whichever list it read.
    def add_finish_observer(self, fn) -> None:
        """Call `fn(req)` once per request as it finishes (any reason), on the scheduler thread under the
        engine lock: it must be quick and must not call the engine. The HTTP server's /metrics uses it."""
        self._finish_observers = [*self._finish_observers, fn]

    def remove_finish_observer(self, fn) -> None:
        self._finish_observers = [f for f in self._finish_observers if f is not fn]

    def _drop_consumer(self, sink, reason: str) -> None:
        """Nobody reads `sink` any more: abort every request that delivers to it and free its KV."""
        sink.closed = True
        victims = [r for r in self._in_flight() if r.sink is sink]
        for req in victims:
            self._abort_in_scheduler(req, f"the caller is gone ({reason})")
            with self._reqs_lock:
                self._reqs.pop(req.rid, None)
            req.finished_time = time.perf_counter()
            self._notify_finished(req)
        if victims:
            logger.warning("dropped %d request(s) whose caller is gone (%s): %s", len(victims), reason,
                           [r.rid for r in victims][:5])

    def _abort_reqs(self, reqs: list[Req], message: str) -> int:
        """Finish each request still in flight as abort with its partial output, and deliver it."""
        n = 0
        for req in reqs:
            with self._reqs_lock:
                if self._reqs.get(req.rid) is not req:
                    continue
            self._abort_in_scheduler(req, message)
            self._deliver(req)
            n += 1
        return n

    def _abort_in_scheduler(self, req: Req, message: str) -> None:
        """Finish req as abort, freeing its KV; it is finished even if the scheduler cannot say so."""
        try:
            aborted = self.scheduler.abort(req, message)
        except Exception:  # its bookkeeping is broken (a bug): still give the caller its output
            logger.exception("aborting request %s failed", req.rid)
            aborted = False
        if not aborted:  # not (or no longer) queued in the scheduler: finish it here
            req.finished_reason = FinishReason("abort", message=message)

    def _fail_all(self, message: str) -> None:
        """Last resort after an unexpected error in the loop: finish every request in flight with the
        reason and start from clean pools (the failure may have left the bookkeeping half-done)."""
        self._take_submissions()
        reqs = self._in_flight()
        self.scheduler.reset()
        for req in reqs:
            req.finished_reason = FinishReason("abort", message=message)
            req.error = message
            self._deliver(req)

    # ---- requests ----------------------------------------------------------------------------
    def _per_prompt(self, name: str, value, num: int, check, none_means=_NO_DEFAULT) -> list:
        """SGLang takes one value for every prompt or a list with one per prompt; `none_means`: what None
        stands for (SGLang's own signature defaults some of these to None), as a whole or per prompt."""
        values = value if isinstance(value, list) else [value] * num
        if none_means is not _NO_DEFAULT:
            values = [none_means if v is None else v for v in values]
        if len(values) != num:
            raise ValueError(f"{name} has {len(values)} entries for {num} prompts")
        for v in values:
            check(v)
        return values

    def _make_reqs(self, prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, rid, stream,
                   return_routed_experts=False, logprob_start_len=None, token_ids_logprob=None,
                   return_original_logprob=None, lora_path=None, encoded=None):
        # `encoded`: prompt_token_ids' result, computed by a caller that tokenizes in its own process
        # (rollout/server/engine_client.py); the engine then never sees the text.
        ids_list, single = encoded if encoded is not None else prompt_token_ids(self.tokenizer, prompt, input_ids)
        if not ids_list:
            raise ValueError("empty batch: no prompts given (prompt or input_ids is an empty list)")
        num = len(ids_list)
        if isinstance(sampling_params, list):
            if len(sampling_params) != num:
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {num} prompts")
            sps = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            sp = SamplingParams.from_dict(sampling_params)
            sps = [sp] * num
        vocab, ctx = self.runner.model_config.vocab_size, self.runner.context_len

        def check_bool(name):
            def check(v):
                if not isinstance(v, bool):
                    raise ValueError(f"{name} must be a bool (or a list of one per prompt), got {v!r}")
            return check

        def check_top(v):
            if not is_integer(v) or not 0 <= v <= vocab:
                raise ValueError(f"top_logprobs_num must be an int in [0, {vocab}] (the vocabulary size), "
                                 f"got {v!r}")

        logprob_flags = self._per_prompt("return_logprob", return_logprob, num, check_bool("return_logprob"), False)
        tops = [int(v) for v in self._per_prompt("top_logprobs_num", top_logprobs_num, num, check_top, 0)]
        routed_flags = self._per_prompt("return_routed_experts", return_routed_experts, num,
                                        check_bool("return_routed_experts"), False)
        if any(routed_flags) and not self.args.enable_return_routed_experts:
            raise ValueError("return_routed_experts=True needs an engine built with enable_return_routed_experts=True "
                             "(a mixture-of-experts model): the routing of every KV slot is kept only then")
        check_bool("stream")(stream)
        lora_names = self._lora_names(lora_path, num)
        starts, id_lists, original = self._logprob_options(ids_list, logprob_start_len, token_ids_logprob,
                                                           return_original_logprob, logprob_flags)
        total = sum(sp.n for sp in sps)
        if total > MAX_SEQUENCES_PER_CALL:  # before one Req each is built: n=10**9 would exhaust host memory
            raise ValueError(f"this call asks for {total} sequences (prompts x sampling param n); one call takes at "
                             f"most {MAX_SEQUENCES_PER_CALL} (split the batch)")
        rids = self._expand_rids(rid, [sp.n for sp in sps], single and sps[0].n == 1)
        reqs = []
        now = time.perf_counter()
        for i, (ids, sp) in enumerate(zip(ids_list, sps)):
            sp.verify(vocab, self.eos_ids)
            if (sp.stop or sp.stop_regex) and self.tokenizer.tokenizer is None:  # else they would never match
                raise ValueError("sampling params stop and stop_regex need a tokenizer (they are matched on text); "
                                 "this engine has none: use stop_token_ids")
            if not ids:
                raise ValueError(f"prompt {i} is empty (input_ids needs at least one token)")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"input_ids of prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")
            if len(ids) >= ctx:
                raise ValueError(f"prompt {i} has {len(ids)} tokens, which is longer than the model's maximum context "
                                 f"length of {ctx} tokens (a prompt must leave room for at least one new token)")
            base_seed = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
            for j in range(sp.n):
                seed = sample_seed(base_seed, j)
                req = Req(rids[len(reqs)], list(ids), sp, seed, logprob_flags[i], tops[i], stream, index=len(reqs),
                          return_routed_experts=routed_flags[i], logprob_start_len=starts[i],
                          token_ids_logprob=id_lists[i], return_original_logprob=original,
                          lora_name=lora_names[i],
                          return_processed_logprob=self.args.logprobs_mode == "processed_logprobs",
                          return_raw_logprob=self.args.logprobs_mode == "raw_logprobs")
                req.created_time = now
                reqs.append(req)
        return reqs, single and sps[0].n == 1

    def _logprob_options(self, ids_list: list[list[int]], logprob_start_len, token_ids_logprob,
                         return_original_logprob, logprob_flags: list[bool]) -> tuple[list[int], list, bool]:
        """SGLang's logprob arguments, validated: logprob_start_len (None/-1 = the last prompt token; an int
        or one per prompt; its range only checked where return_logprob is set, as SGLang ignores it
        elsewhere), token_ids_logprob (ids for every prompt, or one list per prompt), and which
        distribution logprobs come from (None: the SGLANG_RETURN_ORIGINAL_LOGPROB environment variable)."""
        num, vocab = len(ids_list), self.runner.model_config.vocab_size
        starts = logprob_start_len if isinstance(logprob_start_len, list) else [logprob_start_len] * num
        if len(starts) != num:
            raise ValueError(f"logprob_start_len has {len(starts)} entries for {num} prompts")
        for i, (v, ids) in enumerate(zip(starts, ids_list)):
            if v is not None and (not is_integer(v) or (logprob_flags[i] and not -1 <= v < len(ids))):
                raise ValueError(f"logprob_start_len must be -1 (the last prompt token) or a prompt position in "
                                 f"[0, {len(ids)}) for prompt {i} of {len(ids)} tokens, got {v!r}")
        starts = [-1 if v is None or not asked else int(v) for v, asked in zip(starts, logprob_flags)]

        def is_ids(x) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if token_ids_logprob is None or is_ids(token_ids_logprob):
            id_lists = [token_ids_logprob] * num
        elif isinstance(token_ids_logprob, list) and all(x is None or is_ids(x) for x in token_ids_logprob):
            id_lists = token_ids_logprob
            if len(id_lists) != num:
                raise ValueError(f"token_ids_logprob has {len(id_lists)} lists for {num} prompts")
        else:
            raise ValueError(f"token_ids_logprob must be a list of token ids or one list per prompt, "
                             f"got {token_ids_logprob!r}")
        bad = sorted({t for ids in id_lists for t in ids or () if not 0 <= t < vocab})
        if bad:
            raise ValueError(f"token_ids_logprob has ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if return_original_logprob is None:
            env = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "false").lower()
            return_original_logprob = env in ("1", "true", "yes")
        if not isinstance(return_original_logprob, bool):
            raise ValueError(f"return_original_logprob must be a bool or None, got {return_original_logprob!r}")
        # An empty list asks for no ids: no *_token_ids_logprobs keys at all, as SGLang normalizes it to None.
        return starts, [list(ids) if ids else None for ids in id_lists], return_original_logprob

    @staticmethod
    def _expand_rids(rid, ns: list[int], is_single: bool) -> list[str]:
        """SGLang's rid rules, for prompts asking for ns[i] sequences each: None -> fresh ids; a string names a
        single request, or on a batch (or n > 1) expands to f"{rid}_{i}" over every sequence; a list gives one
        per prompt (f"{rid}_{j}" with n > 1, the same n for every prompt)."""
        num_prompts, total = len(ns), sum(ns)
        if rid is None or rid == "":
            return [new_rid() for _ in range(total)]
        if isinstance(rid, str):
            return [rid] if is_single else [f"{rid}_{i}" for i in range(total)]
        if not isinstance(rid, list) or not all(isinstance(r, str) and r for r in rid):
            raise ValueError(f"rid must be a string or a list of non-empty strings, got {rid!r}")
        if len(rid) != num_prompts:
            raise ValueError(f"rid has {len(rid)} entries for {num_prompts} prompts")
        if any(n != ns[0] for n in ns):  # (n 1 and 3 over two prompts once passed as two each)
            raise ValueError(f"a list of rids needs the same n for every prompt, got n={ns}")
        if ns[0] == 1:
            return list(rid)
        return [f"{r}_{j}" for r in rid for j in range(ns[0])]

    def _submit(self, reqs: list[Req], sink) -> None:
        """Queue reqs for the scheduler thread without waiting for the step lock (the checks read flags
        that only change at step boundaries; a request that races a release waits, see _can_step)."""
        release_thread_pool()  # the caller waits for the steps now: its idle OpenMP pool would slow them
        with self._reqs_lock:
            if self._shutdown or not self._thread.is_alive():
                raise RuntimeError("engine is shut down")
            if not self.runner.weights_valid and not self._paused:
                # While paused they wait like any request: the trainer is expected to load weights before
                # continue_generation() (if it does not, they fail then with this same message).
                raise RuntimeError(self.runner.invalid_weights_message())
            resident = self.runner.memory_saver.is_resident("weights") and \
                self.runner.memory_saver.is_resident("kv_cache")
            if not resident and not self._paused:
                # While paused (an RL loop between rollouts) requests queue and start after resume and
                # continue_generation(); otherwise nothing would ever run them: say so.
                raise RuntimeError("memory is released: call resume_memory_occupation() before generate "
                                   "(or pause_generation() first to queue requests until then)")
            self._bind_loras(reqs)  # under the lock: an unload cannot slip in between
            dup = [r.rid for r in reqs if r.rid in self._reqs]
            if dup or len({r.rid for r in reqs}) != len(reqs):
                raise ValueError(f"request id(s) already in flight: {dup or 'duplicates in this call'}")
            for req in reqs:
                req.sink = sink
                req.weight_version_start = self.weight_version
                self._reqs[req.rid] = req
                self._inbox.append(req)
        self.scheduler.interrupt_block()
        self._cv.notify_all()

    def _output(self, req: Req, final: bool) -> dict:
        return build_output(req, self.tokenizer, req.weight_version if final else self.weight_version, final)

    # The parameters up to `stream` take sglang.Engine.generate's positions (image_data, audio_data, video_data,
    # custom_logit_processor and return_hidden_states are taken at their neutral values only: sglang_generate_args).
    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None, audio_data=None,
                 video_data=None, return_logprob: bool | list[bool] | None = False,
                 logprob_start_len: int | list[int] | None = None, top_logprobs_num: int | list[int] | None = 0,
                 token_ids_logprob: list[int] | list[list[int]] | None = None,
                 lora_path: str | list[str | None] | None = None, custom_logit_processor=None,
                 return_hidden_states: bool = False, return_routed_experts: bool | list[bool] = False,
                 stream: bool = False, rid=None, show_progress: bool | None = None,
                 return_original_logprob: bool | None = None, **sglang_args):
        """Blocking generation. One dict for a single prompt with n=1, else a list (n dicts per prompt).
        stream=True returns an iterator of chunk dicts (of every request of the call, each with "index").
        return_routed_experts=True (MoE, engine built with enable_return_routed_experts): the final
        meta_info["routed_experts"] is SGLang's base64 of int32 [prompt + completion - 1, num_layers, top_k],
        the experts of every position the model processed, prompt first; -1 for dense layers.

        Logprobs (return_logprob=True), as SGLang: meta_info["input_token_logprobs"] scores the prompt from
        position logprob_start_len on (default -1: only the last prompt token; its first entry is None),
        "output_token_logprobs" every new token; top_logprobs_num adds "input_top_logprobs" /
        "output_top_logprobs", token_ids_logprob (ids) adds "input_token_ids_logprobs" /
        "output_token_ids_logprobs". max_new_tokens=0 only scores the prompt. The distribution is SGLang's:
        log_softmax(logits / temperature) over the whole vocabulary, after penalties and logit_bias but
        before top-k/top-p/min-p (greedy at temperature 1); the engine's logprobs_mode="processed_logprobs"
        reports the truncated, renormalised distribution sampled from instead (prompt positions are never
        truncated). return_original_logprob=True (default: the SGLANG_RETURN_ORIGINAL_LOGPROB environment
        variable) gives SGLang's original logprobs: the penalised, biased logits without the temperature; the
        engine's logprobs_mode="raw_logprobs" the log-softmax of the raw logits, before every processor.
        lora_path: the name of a loaded LoRA adapter for every prompt, or one name (or None, the base model)
        per prompt (rollout/lora_api.py).
        Other sglang.Engine.generate arguments (image_data, custom_logit_processor, return_hidden_states,
        routed_dp_rank, ...) are taken at their neutral value and refused otherwise, naming the argument
        (rollout/sglang_generate_args.py)."""
        check_generate_args(dict(sglang_args, image_data=image_data, audio_data=audio_data, video_data=video_data,
                                 custom_logit_processor=custom_logit_processor,
                                 return_hidden_states=return_hidden_states))
        reqs, single = self._make_reqs(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                       rid, stream, return_routed_experts, logprob_start_len, token_ids_logprob,
                                       return_original_logprob, lora_path)
        sink = SyncSink(self._thread.is_alive)
        self._submit(reqs, sink)
        if stream:
            return SyncStream(reqs, sink, self._output, self._abort_quietly, segments=self.args.stream_output)
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

    def _abort_quietly(self, reqs: list[Req]) -> None:
        """The caller stopped listening (closed stream, cancelled coroutine): stop spending compute. Posted
        to the scheduler thread (done at the next step boundary): the caller may be an event loop."""
        self._posted_aborts.append((list(reqs), "the caller stopped reading"))
        self.scheduler.interrupt_block()
        self._cv.notify_all()

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None, audio_data=None,
                             video_data=None, return_logprob: bool | list[bool] | None = False,
                             logprob_start_len: int | list[int] | None = None,
                             top_logprobs_num: int | list[int] | None = 0,
                             token_ids_logprob: list[int] | list[list[int]] | None = None,
                             lora_path: str | list[str | None] | None = None, custom_logit_processor=None,
                             return_hidden_states: bool = False, return_routed_experts: bool | list[bool] = False,
                             stream: bool = False, rid=None, return_original_logprob: bool | None = None,
                             **sglang_args):
        """asyncio twin of generate (the same positions): many coroutines share the engine, each awaiting its
        own results."""
        check_generate_args(dict(sglang_args, image_data=image_data, audio_data=audio_data, video_data=video_data,
                                 custom_logit_processor=custom_logit_processor,
                                 return_hidden_states=return_hidden_states), "async_generate")
        reqs, single = self._make_reqs(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                       rid, stream, return_routed_experts, logprob_start_len, token_ids_logprob,
                                       return_original_logprob, lora_path)
        sink = AsyncSink(asyncio.get_running_loop())
        self._submit(reqs, sink)
        if stream:
            return AsyncStream(reqs, sink, self._output, self._abort_quietly, segments=self.args.stream_output)
        return await gather_final_outputs(sink, reqs, self._output, lambda: self._abort_quietly(reqs), single)

    # ---- control (SGLang's semantics) -------------------------------------------------------------
    @property
    def server_args(self):
        """SGLang's Engine.server_args: this engine's options (EngineArgs, SGLang's field names)."""
        return self.args

    @functools.cached_property
    def tokenizer_manager(self):
        """SGLang's Engine.tokenizer_manager, the calls RL code makes on it (rollout/tokenizer_manager_view.py)."""
        from rollout.tokenizer_manager_view import TokenizerManagerView

        return TokenizerManagerView(self)

    def abort_request(self, rid: str = "", abort_all: bool = False, abort_message: str | None = None) -> int:
        """Abort requests in flight; each returns what it generated so far with finish_reason
        {"type": "abort", "message": ...}, the message `abort_message` when given (SGLang's AbortReq field).
        As SGLang: `abort_all=True` aborts every request in flight;
        otherwise, if `rid` is the id of a request in flight, every request in flight whose id starts
        with `rid` is aborted (SGLang matches by prefix once the id is known), and an unknown or finished
        id is a no-op. Returns how many requests were aborted (0: nothing was in flight under that id)."""
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            raise TypeError(f"abort_request takes rid: str and abort_all: bool, got {rid!r}, {abort_all!r}")
        if abort_message is not None and not isinstance(abort_message, str):
            raise TypeError(f"abort_request: abort_message must be a string or None, got {abort_message!r}")
        with self._cv:
            in_flight = self._in_flight()
            if abort_all:
                victims = in_flight
            elif any(r.rid == rid for r in in_flight):
                victims = [r for r in in_flight if r.rid.startswith(rid)]
            else:
                return 0
            message = abort_message or "aborted by abort_request" + (" (abort_all)" if abort_all else "")
            # SGLang's wording for a request that was not running (never admitted, or retracted back to
            # the queue, its partial output kept): clients tell the two apart by it.
            waiting = [r for r in victims if self.scheduler.is_waiting(r) or r in self._inbox]
            return (self._abort_reqs(waiting, abort_message or WAITING_ABORT_MESSAGE)
                    + self._abort_reqs([r for r in victims if not any(r is w for w in waiting)], message))

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating until continue_generation(). SGLang's modes:
        "abort": every request in flight is aborted (partial outputs returned);
        "retract": running requests go back to the waiting queue, their KV freed (into the prefix cache,
            so flush_cache() now succeeds); they recompute it and go on after continue_generation();
        "in_place": requests keep their KV and simply stop; continue_generation() resumes them.
        Requests submitted while paused wait. Weight updates and memory release while paused retract
        whatever is still in flight (see WeightsAPI)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._require_not_shut_down("pause_generation")
        with self._cv:
            self._paused = True
            self._pause_watchdog.arm()
            if mode == "abort":
                self._abort_reqs(self._in_flight(), "aborted by pause_generation(mode='abort')")
            elif mode == "retract":
                self.scheduler.retract_all()

    def continue_generation(self) -> None:
        self._require_not_shut_down("continue_generation")
        self._pause_watchdog.disarm()
        self._continue("continue_generation()")

    def _continue_after_timeout(self, timer) -> None:
        with self._cv:  # pause_generation arms under this lock: a newer pause has replaced `timer`, or waits
            if self._pause_watchdog.claim(timer):
                self._continue("the pause watchdog's continue")

    def _continue(self, what: str) -> None:
        """Unpause. If weights or KV cache are released, nothing could run the requests in flight (and a new
        one is refused with the same words): they end as abort now instead of waiting unseen."""
        with self._cv:
            self._paused = False
            saver = self.runner.memory_saver
            if not (saver.is_resident("weights") and saver.is_resident("kv_cache")):
                self._abort_reqs(self._in_flight(), f"memory is released: {what} came before "
                                                    f"resume_memory_occupation() (resume first, then continue "
                                                    f"generation)")
            self._cv.notify_all()
