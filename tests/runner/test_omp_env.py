"""Processes the engine starts (the server's engine process, tensor-parallel ranks) get GOMP_SPINCOUNT=10000
unless the user's environment chose a libgomp wait already; the caller's own environment is left as it was."""

from __future__ import annotations

import os

import pytest

from rollout import Engine
from rollout.server.engine_client import EngineClient
from runner import omp_env


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [e.decode(errors="replace").split("=", 1) for e in f.read().split(b"\0") if b"=" in e]
    return dict(items)


def test_defaults_yield_to_the_users_choice(monkeypatch):
    """No choice made: the children get 10000; GOMP_SPINCOUNT or OMP_WAIT_POLICY set: nothing is added; the
    variable is gone again after the spawn."""
    for k in omp_env.USER_CHOICES:
        monkeypatch.delenv(k, raising=False)
    with omp_env.for_children() as added:
        assert added == {"GOMP_SPINCOUNT": "10000"} and os.environ["GOMP_SPINCOUNT"] == "10000"
    assert "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with omp_env.for_children() as added:
        assert added == {} and "GOMP_SPINCOUNT" not in os.environ


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads a child's environment from /proc")
def test_the_engine_process_and_tp_ranks_start_with_the_spin_count(tiny_llama, monkeypatch):
    """The server's engine process and a rank-1 worker see GOMP_SPINCOUNT=10000 in their environment (libgomp
    reads it as they load torch); this process does not."""
    for k in omp_env.USER_CHOICES:
        monkeypatch.delenv(k, raising=False)
    client = EngineClient.spawn({"model_path": str(tiny_llama), "show_progress": False, "max_total_tokens": 512},
                                start_timeout_s=300)
    try:
        assert _environ(client.pid).get("GOMP_SPINCOUNT") == "10000"
    finally:
        client.shutdown(timeout_s=30)
    with Engine(str(tiny_llama), tp_size=2, show_progress=False, max_total_tokens=512) as engine:
        workers = engine.runner.procs
        assert workers and all(_environ(p.pid).get("GOMP_SPINCOUNT") == "10000" for p in workers)
    assert "GOMP_SPINCOUNT" not in os.environ


def test_importing_rollout_before_torch_sets_the_spin_count_before_torch_loads():
    """`import rollout` first: GOMP_SPINCOUNT is in the environment when torch (and libgomp) is first imported;
    imported after torch, or with the user's own choice, it adds nothing."""
    import subprocess
    import sys

    probe = ("import builtins, os, sys\n"
             "seen = []\n"
             "real = builtins.__import__\n"
             "def hook(name, *a, **k):\n"
             "    if name == 'torch' and 'torch' not in sys.modules and not seen:\n"
             "        seen.append(os.environ.get('GOMP_SPINCOUNT'))\n"
             "    return real(name, *a, **k)\n"
             "builtins.__import__ = hook\n"
             "{first}\n"
             "import rollout\n"
             "print(seen[0] if seen else 'torch was imported first', os.environ.get('GOMP_SPINCOUNT'))\n")
    env = {k: v for k, v in os.environ.items() if k not in omp_env.USER_CHOICES}

    def run(first: str, **extra) -> str:
        out = subprocess.run([sys.executable, "-c", probe.format(first=first)], env={**env, **extra},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert run("") == ["10000", "10000"]
    assert run("import torch") == ["None", "None"]
    assert run("", OMP_WAIT_POLICY="PASSIVE") == ["None", "None"]


def test_threads_starting_children_together_all_pass_the_spin_count(monkeypatch):
    """Two threads inside for_children at once: each sees the engine's 10000 (the second took the first's value
    for the user's choice and added nothing), and the variable stays until the last leaves."""
    import threading

    for k in omp_env.USER_CHOICES:
        monkeypatch.delenv(k, raising=False)
    inside, release, seen = threading.Barrier(2), threading.Event(), []

    def start_child():
        with omp_env.for_children():
            inside.wait(timeout=30)
            seen.append(os.environ.get("GOMP_SPINCOUNT"))
            release.wait(timeout=30)

    threads = [threading.Thread(target=start_child) for _ in range(2)]
    for t in threads:
        t.start()
    while len(seen) < 2:
        pass
    release.set()
    for t in threads:
        t.join(timeout=30)
    assert seen == ["10000", "10000"] and "GOMP_SPINCOUNT" not in os.environ


def test_the_trainers_engine_process_starts_with_the_spin_count(tiny_llama, monkeypatch):
    """The trainers' --engine-process (a RemoteEngine: weight_sync stays free of runner, so the trainers pass
    the variable as its child_env) gets it too: that child imports torch before rollout."""
    from trainers.engines import engine_process

    for k in omp_env.USER_CHOICES:
        monkeypatch.delenv(k, raising=False)
    remote = engine_process(str(tiny_llama), device="cpu", show_progress=False, max_total_tokens=512)
    try:
        assert _environ(remote._proc.pid).get("GOMP_SPINCOUNT") == "10000"
    finally:
        remote.shutdown()
