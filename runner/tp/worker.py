"""The body of a tensor-parallel worker process (ranks 1..N-1): build this rank's runner, then serve
rank 0's commands until told to stop or until rank 0 is gone.

Each command (forward, release, resume, a weight update, a LoRA load/unload, a weight read, shutdown)
gets exactly one reply `{"ok": bool, "error": str}`; a weight update or LoRA change also sends one vote
and waits for rank 0's decision before it commits (runner/tp/rank_runner.py). The worker exits when its parent
dies (the pipe closes, or the parent pid changes) and a collective with a dead peer fails within the
group's timeout, so no worker outlives the engine.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import traceback

import torch

from runner.config import RunnerConfig
from runner.tp import channel
from runner.tp.group import TPGroup
from runner.tp.rank_runner import TPRankRunner, apply_batch
from runner.weights import checker, delta

logger = logging.getLogger(__name__)


def worker_main(config_json: str, rank: int, port: int, backend: str, timeout_s: float, conn) -> None:
    parent = os.getppid()
    config = RunnerConfig(**json.loads(config_json))
    torch.set_num_threads(max(1, torch.get_num_threads() // config.tp_size))
    try:
        tp = TPGroup(rank, config.tp_size, port, backend, timeout_s)
        runner = TPRankRunner(config, tp)
    except Exception as e:
        channel.send(conn, {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
        return
    channel.send(conn, {"ok": True, "max_total_num_tokens": runner.max_total_num_tokens})
    try:
        _serve(runner, conn, lambda: os.getppid() == parent, timeout_s)
    except channel.ChannelClosed:
        pass  # rank 0 is gone: nothing left to serve
    finally:
        try:
            runner.shutdown()
            tp.close()
        except Exception:
            pass


def _serve(runner: TPRankRunner, conn, parent_alive, timeout_s: float) -> None:
    while True:
        header, tensors = channel.recv(conn, None, parent_alive, "rank 0")
        cmd = header["cmd"]
        reply: dict = {"ok": True}
        out: list[torch.Tensor] = []
        try:
            if cmd == "forward":
                runner.forward(apply_batch(header["batch"], tensors, runner))
            elif cmd == "release":
                runner.release_memory_occupation(header["tags"])
            elif cmd == "resume":
                runner.resume_memory_occupation(header["tags"])
            elif cmd == "delta_partials":
                reply["partials"] = delta.partial_hashes(runner, tensors[0])
            elif cmd in ("update_tensor", "update_disk", "update_delta", "lora_load", "lora_unload"):
                _voted(runner, conn, functools.partial(_update, runner, header, tensors), parent_alive, timeout_s)
            elif cmd == "lora_adapters":
                reply["adapters"] = runner.lora_adapters()
            elif cmd == "checksum":
                reply["checksum"], reply["num_tensors"] = checker.parameters_sha256(runner.model)
            elif cmd == "get_shard":
                shard, spec = runner.weight_shard(header["name"])
                out, reply["spec"] = [shard], spec
            elif cmd == "shutdown":
                channel.send(conn, reply)
                return
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        channel.send(conn, reply, out)


def _update(runner: TPRankRunner, header: dict, tensors: list[torch.Tensor]):
    """One weight update or LoRA load/unload; its writer (or before_lora_commit) votes through vote_fn."""
    cmd = header["cmd"]
    if cmd == "update_tensor":
        return runner.update_weights_from_tensor(list(zip(header["names"], tensors)))
    if cmd == "update_delta":  # this rank applies its slice; rank 0 checked the sums
        return runner.update_weights_from_tensor(tensors[0], "delta")
    if cmd == "update_disk":
        return runner.update_weights_from_disk(header["path"])
    if cmd == "lora_unload":
        return runner.unload_lora_adapter(header["name"])
    staged = runner.stage_lora_adapter(header["name"], None, list(zip(header["names"], tensors)), header["config"],
                                       pinned=header["pinned"])
    staged.path = header["path"]  # rank 0 read the directory and sent its tensors
    return runner.commit_lora_adapter(staged, header["uid"])


def _voted(runner: TPRankRunner, conn, call, parent_alive, timeout_s: float):
    """Run `call`; vote once (ok from inside it, or the error), obey rank 0's decision."""
    voted = False

    def vote() -> str | None:
        nonlocal voted
        channel.send(conn, {"vote": "ok"})
        voted = True
        decision, _ = channel.recv(conn, timeout_s, parent_alive, "rank 0")
        return None if decision["commit"] else "another tensor-parallel rank refused this update"

    runner.vote_fn = vote
    try:
        return call()
    except Exception as e:
        if not voted:
            channel.send(conn, {"vote": "fail", "error": f"{type(e).__name__}: {e}"})
            channel.recv(conn, timeout_s, parent_alive, "rank 0")  # the (abort) decision
        raise
    finally:
        runner.vote_fn = None
