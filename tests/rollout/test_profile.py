"""Engine.start_profile / stop_profile: torch.profiler traces of the engine's own steps.

Oracles: the trace file read back with gzip + json (not through the profiler), the scheduler thread's
native id from `threading`, the step count from the engine's scheduler stats, and HF greedy generation
for "the engine keeps serving" after refused calls.
"""

from __future__ import annotations

import gzip
import json
import re

import pytest

from tests.rollout.oracle import hf_generate

PROMPT = [5, 6, 7, 8, 9]
SP = dict(max_new_tokens=6, temperature=0, ignore_eos=True)
# The plain schedule, whose steps are each a range on the scheduler thread (the overlap schedule has its own test).
KW = dict(device="cpu", show_progress=False, disable_cuda_graph=True, disable_overlap_schedule=True)


def _trace(message: str) -> list[dict]:
    path = re.search(r"(\S+\.trace\.json\.gz)", message).group(1)
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _steps(events: list[dict]) -> list[int]:
    return sorted(int(e["name"].rsplit("_", 1)[1]) for e in events
                  if str(e.get("name", "")).startswith("engine_step_") and e.get("ph") == "X")


def _num_steps(engine) -> int:
    s = engine.scheduler.stats
    return s["num_prefill_steps"] + s["num_decode_steps"]


def test_trace_holds_the_forward_ops_of_the_scheduler_thread(make_engine, tiny_llama, tmp_path):
    """A profile around one generate writes a Chrome trace that parses as JSON, has one range per engine
    step run, and holds the model's aten ops (matmuls, attention) on the scheduler thread."""
    engine = make_engine(tiny_llama, **KW)
    msg = engine.start_profile(output_dir=str(tmp_path))
    assert str(tmp_path) in msg and "given" in msg
    steps_before = _num_steps(engine)
    engine.generate(input_ids=PROMPT, sampling_params=SP)
    msg = engine.stop_profile()
    events = _trace(msg)
    num_run = _num_steps(engine) - steps_before
    assert num_run == SP["max_new_tokens"]  # one prefill + decodes; the last token needs no forward
    assert len(_steps(events)) == num_run
    aten = [e for e in events if str(e.get("name", "")).startswith("aten::")]
    names = {e["name"] for e in aten}
    assert names & {"aten::linear", "aten::mm", "aten::addmm"}, sorted(names)[:30]
    kernels = {e["name"] for e in events if str(e.get("name", "")).startswith("rollout_cpu::")}
    attention = {n for n in names | kernels if "dot_product" in n or n == "aten::bmm" or "paged_" in n}
    assert attention, sorted(names | kernels)  # SDPA, or the engine's paged CPU kernel (runner/cpu_kernels.py)
    assert {e["tid"] for e in aten} == {engine._thread.native_id}


def test_num_steps_stops_by_itself(make_engine, tiny_llama, tmp_path):
    """With num_steps=3 the profile ends after exactly three engine steps without stop_profile, and a
    later stop_profile is refused naming the profile that already ended."""
    engine = make_engine(tiny_llama, **KW)
    engine.start_profile(output_dir=str(tmp_path), num_steps=3)
    first = _num_steps(engine)
    engine.generate(input_ids=PROMPT, sampling_params=SP)
    files = list(tmp_path.glob("*.trace.json.gz"))
    assert len(files) == 1
    with gzip.open(files[0], "rt") as f:
        events = json.load(f)["traceEvents"]
    assert _steps(events) == [first, first + 1, first + 2]
    with pytest.raises(ValueError, match="no profile is running.*num_steps=3"):
        engine.stop_profile()


def test_start_step_waits_for_that_engine_step(make_engine, tiny_llama, tmp_path):
    """start_step=k begins the trace at engine step k (counted from engine start): the first range is k."""
    engine = make_engine(tiny_llama, **KW)
    engine.generate(input_ids=PROMPT, sampling_params=SP)
    k = _num_steps(engine) + 2
    msg = engine.start_profile(output_dir=str(tmp_path), start_step=k, num_steps=2)
    assert f"engine step {k}" in msg
    engine.generate(input_ids=PROMPT, sampling_params=SP)
    (path,) = tmp_path.glob("*.trace.json.gz")
    with gzip.open(path, "rt") as f:
        assert _steps(json.load(f)["traceEvents"]) == [k, k + 1]


def test_default_output_dir_is_the_sglang_env_variable(make_engine, tiny_llama, tmp_path, monkeypatch):
    """Without output_dir the trace goes to SGLANG_TORCH_PROFILER_DIR, and the message says so."""
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    engine = make_engine(tiny_llama, **KW)
    msg = engine.start_profile()
    assert "SGLANG_TORCH_PROFILER_DIR" in msg
    engine.generate(input_ids=PROMPT, sampling_params=SP)
    engine.stop_profile()
    assert len(list((tmp_path / "traces").glob("*.trace.json.gz"))) == 1


def test_bad_profile_calls_are_refused_and_the_engine_keeps_serving(make_engine, hf_models, tiny_llama, tmp_path):
    """GPU activity on a CPU engine, an unknown activity, profile_by_stage, a second start and a stop
    without a profile each raise ValueError naming the problem; greedy output still equals HF's."""
    engine = make_engine(tiny_llama, **KW)
    for kwargs, pattern in [(dict(activities=["GPU"]), "'GPU' needs a CUDA engine"),
                            (dict(activities=["CUDA", "CPU"]), "'CUDA' needs a CUDA engine"),
                            (dict(activities=["MEM"]), "'MEM' is not supported"),
                            (dict(profile_by_stage=True), "profile_by_stage"),
                            (dict(num_steps=0), "num_steps"),
                            (dict(output_dir=str(tmp_path / "f" / "x")), None)]:
        if pattern is None:  # output_dir under a regular file cannot be created
            (tmp_path / "f").write_text("")
            pattern = "cannot be created"
        with pytest.raises(ValueError, match=pattern):
            engine.start_profile(**kwargs)
    with pytest.raises(ValueError, match="no profile is running"):
        engine.stop_profile()
    engine.start_profile(output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="already running"):
        engine.start_profile(output_dir=str(tmp_path))
    out = engine.generate(input_ids=PROMPT, sampling_params=SP)
    engine.stop_profile()
    assert out["output_ids"] == hf_generate(hf_models(tiny_llama), PROMPT, SP["max_new_tokens"])[0]


def test_overlap_schedule_profiles_the_forward_worker(make_engine, tiny_llama, tmp_path):
    """With the overlap schedule the model's aten ops run on its forward worker, and the trace holds them
    there (a profile on the scheduler thread would hold none)."""
    engine = make_engine(tiny_llama, **{**KW, "disable_overlap_schedule": False})
    worker = engine.scheduler.overlap.worker._thread
    engine.start_profile(output_dir=str(tmp_path))
    engine.generate(input_ids=PROMPT, sampling_params=SP)
    events = _trace(engine.stop_profile())
    aten = [e for e in events if str(e.get("name", "")).startswith("aten::")]
    assert {e["name"] for e in aten} & {"aten::linear", "aten::mm", "aten::addmm"}
    assert {e["tid"] for e in aten} == {worker.native_id}
