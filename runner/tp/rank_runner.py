"""One tensor-parallel rank's ModelRunner, and the ForwardBatch as it travels to the other ranks.

`TPRankRunner` is a ModelRunner whose model is built for its rank (runner/tp/group.py `building`), whose
KV pool holds only its KV heads, and whose weight writes wait for a vote before they commit: a writer
that wrote everything asks `vote()` whether every rank did too, and restores its slices if not (the
all-or-nothing loader, made all-or-nothing across ranks); a LoRA load or unload votes the same way
once checked, before it changes anything. Captured decode steps are off under TP
(collectives inside a captured step are not verified here).

`encode_batch` / `apply_batch` carry a ForwardBatch (with its requests' LoRA uids) plus the req_to_token rows it reads (the scheduler
keeps KV bookkeeping on rank 0 only), so every rank's pool sees the same slots. Sampling info stays on
rank 0. Nothing here spawns processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from runner.config import RunnerConfig
from runner.forward_batch import ForwardBatch, ForwardMode
from runner.layers.linear import tp_slice
from runner.model_runner import ModelRunner
from runner.tp.group import TPGroup, building
from runner.weights.loader import WeightUpdateError, WeightWriter


class VotingWriter(WeightWriter):
    """A WeightWriter whose successful block commits only if `vote()` returns None (every rank
    succeeded); otherwise it restores what it wrote and raises the vote's reason."""

    def __init__(self, vote: Callable[[], str | None]) -> None:
        super().__init__(snapshot=True)
        self.vote = vote

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            reason = self.vote()
            if reason is not None:
                exc = WeightUpdateError(reason)
                return super().__exit__(type(exc), exc, None)  # restores, then raises
        return super().__exit__(exc_type, exc, tb)


class TPRankRunner(ModelRunner):
    def __init__(self, config: RunnerConfig, tp: TPGroup) -> None:
        self.tp = tp
        self.vote_fn: Callable[[], str | None] | None = None  # set around one update by the caller
        super().__init__(config)

    def load_model(self) -> None:
        with building(self.tp):
            super().load_model()

    def init_memory_pool(self) -> None:
        # The pool holds this rank's KV heads only (replicated ones included).
        full = self.model_config
        local = max(1, full.num_key_value_heads // self.tp.size)
        self.model_config = dataclasses.replace(full, num_key_value_heads=local)
        try:
            super().init_memory_pool()
        finally:
            self.model_config = full

    def init_device_graphs(self) -> None:
        self.graph_runner = None

    def new_weight_writer(self) -> WeightWriter:
        return VotingWriter(lambda: self.vote_fn() if self.vote_fn is not None else None)

    def load_initial_lora_adapters(self) -> None:
        pass  # TPModelRunner loads lora_paths through every rank, with rank 0's uids

    def before_lora_commit(self) -> None:
        reason = self.vote_fn() if self.vote_fn is not None else None
        if reason is not None:
            raise ValueError(reason)

    def weight_shard(self, name: str) -> tuple[torch.Tensor, tuple[int, int, int, int] | None]:
        """This rank's part of HF weight `name` (padding dropped) and its (dim, start, size, full)."""
        self._require_weights_resident()
        target = self.name_map.resolve(name)
        view, spec = target.view(), tp_slice(target.param, target.shard_id)
        if spec is not None:
            view = view.narrow(spec[0], 0, spec[2])
        return view, spec


_INT_FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")
_OPT_FIELDS = ("input_embeds", "replace_embeds", "replace_positions")


def encode_batch(fb: ForwardBatch, req_to_token: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
    """A JSON-able header and the tensors of `fb`, plus each request's req_to_token[:seq_len] row."""
    max_len = max(fb.seq_lens_cpu, default=0)
    mask = torch.arange(max_len, device=fb.seq_lens.device)[None] < fb.seq_lens[:, None]  # [bs, max_len]
    rows = req_to_token[fb.req_pool_indices, :max_len][mask]  # [sum(seq_lens)]
    opt = [f for f in _OPT_FIELDS if getattr(fb, f) is not None]
    header = {"mode": int(fb.forward_mode), "batch_size": fb.batch_size, "seq_lens_cpu": fb.seq_lens_cpu,
              "extend_prefix_lens_cpu": fb.extend_prefix_lens_cpu, "extend_seq_lens_cpu": fb.extend_seq_lens_cpu,
              "return_all_logits": fb.return_all_logits, "final_seq_lens_cpu": fb.final_seq_lens_cpu,
              "optional": opt, "lora_ids": fb.lora_ids}
    return header, [getattr(fb, f) for f in _INT_FIELDS] + [rows] + [getattr(fb, f) for f in opt]


def apply_batch(header: dict, tensors: list[torch.Tensor], runner: ModelRunner) -> ForwardBatch:
    """Write the rows into this rank's req_to_token and rebuild the ForwardBatch on its device."""
    dev = runner.device
    tensors = [t.to(dev) for t in tensors]
    ints = dict(zip(_INT_FIELDS, tensors[: len(_INT_FIELDS)]))
    rows = tensors[len(_INT_FIELDS)]
    opt = dict(zip(header["optional"], tensors[len(_INT_FIELDS) + 1:]))
    max_len = max(header["seq_lens_cpu"], default=0)
    if max_len:
        cols = torch.arange(max_len, device=dev)[None].expand(header["batch_size"], -1)
        mask = cols < ints["seq_lens"][:, None]
        idx = ints["req_pool_indices"][:, None].expand(-1, max_len)
        runner.req_to_token_pool.req_to_token[idx[mask], cols[mask]] = rows.to(runner.req_to_token_pool.req_to_token.dtype)
    return ForwardBatch(ForwardMode(header["mode"]), header["batch_size"], seq_lens_cpu=header["seq_lens_cpu"],
                        extend_prefix_lens_cpu=header["extend_prefix_lens_cpu"],
                        extend_seq_lens_cpu=header["extend_seq_lens_cpu"],
                        return_all_logits=header["return_all_logits"],
                        final_seq_lens_cpu=header.get("final_seq_lens_cpu"), lora_ids=header["lora_ids"], **ints,
                        **opt)
