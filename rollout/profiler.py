"""torch.profiler over the engine's steps: SGLang's start_profile / stop_profile.

torch.profiler records the ops of the thread that started it only (measured: a profile started on
one thread holds no aten op of another), so the profiler lives on the thread that runs the model: the
scheduler thread, or with the overlap schedule its forward worker (rollout/overlap.py), where every
decode forward runs (and, on the CPU, every prefill). Control calls only post requests: `StepProfiler.service()`, called by the scheduler
thread at every step boundary (and when it wakes), starts a requested profile (at once, or before the
engine step `start_step`) and stops one that was asked to stop; `after_step()` counts profiled steps and
stops by itself after `num_steps` (SGLang's semantics). A stopped profile is written as a Chrome trace,
`<output_dir>/<profile_id>-TP-0.trace.json.gz` (chrome://tracing, Perfetto). Without the overlap
schedule each step is a range `engine_step_<n>` in the trace.

What it does not do: profile the CPU ops of other threads (control calls; with the overlap schedule on
CUDA, prefills on the scheduler thread; their GPU kernels are traced, CUPTI being process-wide), mark
step ranges under the overlap schedule (the steps run on the worker, behind the one launched ahead, so
the window is shifted by that step), tensor-parallel ranks 1..N-1 (other processes), per-stage traces
(profile_by_stage is refused), or memory snapshots (activity "MEM").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import threading
import time

import torch
from torch.profiler import ProfilerActivity

logger = logging.getLogger(__name__)

ACTIVITIES = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA, "CUDA": ProfilerActivity.CUDA}
WAIT_POLL_S = 0.5  # how often a waiting caller checks that the scheduler thread is still alive


@dataclasses.dataclass
class ProfileConfig:
    output_dir: str
    activities: list[str]  # keys of ACTIVITIES, validated
    start_step: int | None = None  # the engine step (counted from 0 since start) to begin at; None: now
    num_steps: int | None = None  # stop by itself after this many profiled steps; None: at stop_profile
    with_stack: bool = True
    record_shapes: bool = False
    profile_id: str = ""

    @property
    def trace_path(self) -> str:
        return os.path.join(self.output_dir, f"{self.profile_id}-TP-0.trace.json.gz")


def make_config(device_type: str, output_dir: str | None, start_step: int | None, num_steps: int | None,
                activities: list[str] | None, profile_by_stage: bool, with_stack: bool | None,
                record_shapes: bool | None) -> ProfileConfig:
    """start_profile's arguments, validated (ValueError naming the argument); creates output_dir."""
    if profile_by_stage is not False:
        raise ValueError("start_profile: profile_by_stage=True (one trace per prefill/decode stage) is not "
                         "supported by this engine; profile every step (profile_by_stage=False)")
    for name, value in (("start_step", start_step), ("num_steps", num_steps)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"start_profile: {name} must be a non-negative int or None, got {value!r}")
    if num_steps == 0:
        raise ValueError("start_profile: num_steps must be at least 1 (or None: until stop_profile)")
    for name, value in (("with_stack", with_stack), ("record_shapes", record_shapes)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"start_profile: {name} must be a bool or None, got {value!r}")
    if activities is None:
        activities = ["CPU"] + (["GPU"] if device_type == "cuda" else [])
    if not isinstance(activities, list) or not activities:
        raise ValueError(f"start_profile: activities must be a non-empty list of {list(ACTIVITIES)}, "
                         f"got {activities!r}")
    for a in activities:
        if a not in ACTIVITIES:
            raise ValueError(f"start_profile: activity {a!r} is not supported by this engine; choose from "
                             f"{list(ACTIVITIES)}")
        if ACTIVITIES[a] == ProfilerActivity.CUDA and device_type != "cuda":
            raise ValueError(f"start_profile: activity {a!r} needs a CUDA engine; this one runs on "
                             f"{device_type}: use activities=['CPU']")
    if output_dir is None:
        output_dir = os.environ.get("SGLANG_TORCH_PROFILER_DIR") or tempfile.gettempdir()
    if not isinstance(output_dir, str) or not output_dir:
        raise ValueError(f"start_profile: output_dir must be a directory path, got {output_dir!r}")
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"start_profile: output_dir {output_dir!r} cannot be created: {e.strerror or e}") from None
    if not os.path.isdir(output_dir) or not os.access(output_dir, os.W_OK):
        raise ValueError(f"start_profile: output_dir {output_dir!r} is not a writable directory")
    return ProfileConfig(output_dir, list(dict.fromkeys(activities)), start_step, num_steps,
                         True if with_stack is None else with_stack, bool(record_shapes), f"{time.time():.6f}")


@dataclasses.dataclass(eq=False)
class _Session:
    config: ProfileConfig
    profiler: torch.profiler.profile | None = None
    num_profiled: int = 0
    stop_requested: bool = False
    started: threading.Event = dataclasses.field(default_factory=threading.Event)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: str = ""
    outcome: str = ""  # what stopping it produced, for stop_profile's message


class StepProfiler:
    """At most one profile at a time. `request_*` run on control threads; `service`, `after_step` and
    `close` only on the scheduler thread, which starts and stops the profiler through `host(fn)`: fn run
    on the thread that runs the forwards (default: this one). `step_ranges`: that thread is the
    scheduler thread, so each step's range can be recorded."""

    def __init__(self, host=None, step_ranges: bool = True) -> None:
        self._host = host or (lambda fn: fn())
        self._step_ranges = step_ranges
        self._lock = threading.Lock()  # guards _session and last_outcome
        self._session: _Session | None = None
        self.num_steps_run = 0  # engine steps since start: start_step counts in these
        self.last_outcome = ""

    @property
    def busy(self) -> bool:
        """A profile is due or running: the scheduler takes single steps meanwhile (no decode blocks), so that
        num_steps and start_step count engine steps and each step gets its range."""
        return self._session is not None

    # ---- control threads ----------------------------------------------------------------------
    def request_start(self, config: ProfileConfig) -> _Session:
        with self._lock:
            if self._session is not None:
                c = self._session.config
                raise ValueError(f"start_profile: a profile is already running (trace to {c.trace_path}); "
                                 f"call stop_profile first")
            self._session = _Session(config)
            return self._session

    def request_stop(self) -> _Session:
        with self._lock:
            session = self._session
            if session is None:
                last = f" (the last one: {self.last_outcome})" if self.last_outcome else ""
                raise ValueError(f"stop_profile: no profile is running{last}; call start_profile first")
            session.stop_requested = True
            return session

    # ---- the scheduler thread -------------------------------------------------------------------
    def service(self) -> None:
        """At a step boundary: start a profile that is due, stop one asked to stop. Never raises."""
        session = self._session
        if session is None:
            return
        if session.stop_requested:
            self._finish(session, "stopped by stop_profile")
            return
        due = session.config.start_step is None or self.num_steps_run >= session.config.start_step
        if session.profiler is None and due:
            c = session.config
            try:
                prof = torch.profiler.profile(activities=[ACTIVITIES[a] for a in c.activities],
                                              with_stack=c.with_stack, record_shapes=c.record_shapes)
                self._host(prof.start)
            except Exception as e:  # noqa: BLE001 - another profiler on this thread, a Kineto failure
                logger.exception("starting the profiler failed")
                session.error = f"starting the profiler failed: {type(e).__name__}: {e}"
                self._end(session)
                return
            session.profiler = prof
            session.started.set()

    def step_scope(self):
        """Around each step: a trace range named engine_step_<n> while profiling (so a trace shows where
        each engine step begins and ends), else nothing."""
        session = self._session
        if session is None or session.profiler is None or not self._step_ranges:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"engine_step_{self.num_steps_run}")

    def after_step(self, num_steps: int = 1) -> None:
        """num_steps: the forward steps it ran (a decode block runs several; none runs while profiling)."""
        self.num_steps_run += num_steps
        session = self._session
        if session is None or session.profiler is None:
            return
        session.num_profiled += 1
        if session.config.num_steps is not None and session.num_profiled >= session.config.num_steps:
            self._finish(session, f"stopped after num_steps={session.config.num_steps}")

    def close(self) -> None:
        """The engine shuts down: a running profile is written as it is."""
        session = self._session
        if session is not None:
            self._finish(session, "stopped by engine shutdown")

    def _finish(self, session: _Session, why: str) -> None:
        if session.profiler is None:
            session.outcome = f"{why} before it started (start_step={session.config.start_step}); no trace written"
        else:
            path = session.config.trace_path
            prof = session.profiler
            try:
                self._host(lambda: (prof.stop(), prof.export_chrome_trace(path)))
                session.outcome = f"{why}: {session.num_profiled} engine steps, trace written to {path}"
            except Exception as e:  # noqa: BLE001 - a full disk must not stop the scheduler
                logger.exception("writing the profile failed")
                session.error = f"{why}, but writing the trace to {path} failed: {type(e).__name__}: {e}"
                session.outcome = session.error
            session.profiler = None
        self._end(session)

    def _end(self, session: _Session) -> None:
        with self._lock:
            if self._session is session:
                self._session = None
            self.last_outcome = session.outcome or session.error
        session.started.set()
        session.done.set()


def wait(event: threading.Event, thread: threading.Thread, what: str) -> None:
    """Wait for the scheduler thread to act on a request (it does at its next step boundary)."""
    while not event.wait(WAIT_POLL_S):
        if not thread.is_alive():
            raise RuntimeError(f"{what}: the engine is shut down")


class ProfilerAPI:
    """Mixed into Engine: SGLang's start_profile / stop_profile, over `self._profiler` (a StepProfiler
    the scheduler thread drives)."""

    def start_profile(self, output_dir: str | None = None, start_step: int | None = None,
                      num_steps: int | None = None, activities: list[str] | None = None,
                      profile_by_stage: bool = False, with_stack: bool | None = None,
                      record_shapes: bool | None = None) -> str:
        """Profile the engine's steps with torch.profiler (SGLang's arguments): from now, or from engine
        step `start_step`; until stop_profile(), or for `num_steps` steps. output_dir: default the
        SGLANG_TORCH_PROFILER_DIR environment variable, else the system's temp directory. activities:
        "CPU", and "GPU"/"CUDA" on a CUDA engine (the default takes what the device has). Returns a
        message saying where the trace will go; ValueError for bad arguments or a profile already running."""
        if self._shutdown:
            raise RuntimeError("start_profile: the engine is shut down")
        config = make_config(self.runner.device.type, output_dir, start_step, num_steps, activities,
                             profile_by_stage, with_stack, record_shapes)
        session = self._profiler.request_start(config)
        self._cv.notify_all()  # the scheduler thread may be asleep: it starts the profiler when it wakes
        if start_step is None:
            wait(session.started, self._thread, "start_profile")
            if session.error:
                raise RuntimeError(f"start_profile: {session.error}")
            when = "from the next engine step"
        else:
            when = f"from engine step {start_step} (now at step {self._profiler.num_steps_run})"
        until = f"for {num_steps} steps" if num_steps is not None else "until stop_profile"
        source = ("given" if output_dir is not None else "from SGLANG_TORCH_PROFILER_DIR"
                  if os.environ.get("SGLANG_TORCH_PROFILER_DIR") else "the default temp directory")
        return (f"profiling {when} {until}, activities {config.activities}; the trace goes to "
                f"{config.trace_path} (output_dir {config.output_dir!r}: {source})")

    def stop_profile(self) -> str:
        """Stop the running profile and write its trace; returns a message naming the file. ValueError
        when no profile is running (one with num_steps ends by itself)."""
        session = self._profiler.request_stop()
        self._cv.notify_all()
        wait(session.done, self._thread, "stop_profile")
        if session.error:
            raise RuntimeError(f"stop_profile: {session.error}")
        return f"profile {session.outcome}"
