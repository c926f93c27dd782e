"""`python -m rollout.launch_server`: flags from EngineArgs, default bind, readiness log, clean SIGTERM exit."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from rollout.engine_args import EngineArgs
from rollout.launch_server import free_port
from rollout.server.args import build_parser, parse_args


def test_every_engine_arg_is_a_flag():
    """Each EngineArgs field parses from its SGLang-spelled flag into the Engine kwargs; host defaults to 127.0.0.1."""
    server, kw = parse_args(["--model-path", "/m", "--max-total-tokens", "123", "--disable-radix-cache",
                             "--tp-size", "1", "--mem-fraction-static", "0.5", "--api-key", "k"])
    assert server.host == "127.0.0.1" and server.port == 30000 and server.api_key == "k"
    assert kw["model_path"] == "/m" and kw["max_total_tokens"] == 123 and kw["disable_radix_cache"] is True
    assert kw["mem_fraction_static"] == 0.5
    assert set(kw) == {f.name for f in dataclasses.fields(EngineArgs)}
    defaults = EngineArgs(model_path="/m")
    for f in dataclasses.fields(EngineArgs):
        if f.name not in ("model_path", "max_total_tokens", "disable_radix_cache", "mem_fraction_static", "log_level"):
            assert kw[f.name] == getattr(defaults, f.name), f.name
    assert kw["log_level"] == "info"  # SGLang's server default (an in-process Engine's is "warning")


def test_every_flag_has_a_description():
    """`launch_server --help`: every flag (server and engine) has a one-line description, not just a default."""
    parser = build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 50
    for action in flags:
        text = (action.help or "").strip()
        assert text and not text.startswith("(default") and "undocumented" not in text, action.option_strings
    assert "--enable-memory-saver" in parser.format_help()


@pytest.mark.parametrize("flags", [[], ["--log-level", "warning"], ["--no-access-log"]],
                         ids=["default", "log-level-warning", "no-access-log"])
def test_subprocess_ready_and_sigterm(tiny_llama, flags):
    """The server logs its URL when ready, answers, and exits 0 within seconds of SIGTERM, saying so. At
    the default --log-level info each request gets an access-log line and INFO lines of every package
    show; --log-level warning hides every INFO line; --no-access-log drops the access lines only."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rollout.launch_server", "--model-path", str(tiny_llama),
                             "--port", str(port), "--max-total-tokens", "1024", "--disable-cuda-graph", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 90
        lines = []
        while True:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
            if f"ready at http://127.0.0.1:{port}" in line:
                break
            assert time.monotonic() < deadline, "".join(lines)
        r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60,
                       json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) <= 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        out = "".join(lines) + proc.stdout.read()
        assert "rollout server shutting down" in out and "rollout server stopped" in out, out
        access = '"POST /generate HTTP/1.1" 200' in out
        info_lines = [ln for ln in out.splitlines() if " INFO " in ln or ln.startswith("INFO:")]
        if not flags:
            assert access and any("runner.attention" in ln for ln in info_lines), out
        elif flags[0] == "--log-level":
            assert not access and not info_lines, out
        else:
            assert not access and any("runner.attention" in ln for ln in info_lines), out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


def test_server_engine_defaults_to_the_plain_schedule_on_the_cpu(tiny_llama):
    """The server builds a CPU engine with the plain schedule when disable_overlap_schedule is left at None
    (the overlap's second thread has no free core beside the HTTP process); an explicit value is kept, and
    a CUDA device keeps None (the overlap default there)."""
    from rollout.launch_server import build_engine, server_engine_kwargs

    assert server_engine_kwargs({"device": "cpu", "disable_overlap_schedule": None})["disable_overlap_schedule"] is True
    assert server_engine_kwargs({})["disable_overlap_schedule"] is True
    assert server_engine_kwargs({"device": "cpu", "disable_overlap_schedule": False})["disable_overlap_schedule"] is False
    assert server_engine_kwargs({"device": "cuda:0", "disable_overlap_schedule": None})["disable_overlap_schedule"] is None
    server, kw = parse_args(["--model-path", str(tiny_llama), "--max-total-tokens", "1024", "--engine-in-process"])
    engine = build_engine(server, kw)
    try:
        assert engine.scheduler.overlap is None
    finally:
        engine.shutdown()
    server, kw = parse_args(["--model-path", str(tiny_llama), "--max-total-tokens", "1024", "--engine-in-process",
                             "--no-disable-overlap-schedule"])
    engine = build_engine(server, kw)
    try:
        assert engine.scheduler.overlap is not None
    finally:
        engine.shutdown()
