"""Drive a ModelRunner directly with hand-built ForwardBatches, the way the scheduler does.

`RunnerDriver` keeps, per request row, how many tokens are in the KV cache; `extend` and `decode`
allocate KV slots (shuffled, so nothing may assume a request's slots are contiguous), write them
into the request's row and run one forward. No rollout/ code is involved.
"""

from __future__ import annotations

import pathlib

import torch

from runner.config import RunnerConfig
from runner.forward_batch import ForwardBatch, ForwardMode, LogitsOutput
from runner.model_runner import ModelRunner


def make_runner(path: str | pathlib.Path, **kwargs) -> ModelRunner:
    kwargs = {"device": "cpu", "max_total_tokens": 1024, "max_running_requests": 16, **kwargs}
    return ModelRunner(RunnerConfig(model_path=str(path), **kwargs))


def _i64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


class RunnerDriver:
    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.cached: dict[int, int] = {}  # row -> tokens in the KV cache
        self.gen = torch.Generator().manual_seed(seed)

    def new_request(self) -> int:
        row = self.runner.req_to_token_pool.alloc()
        self.cached[row] = 0
        return row

    def _alloc(self, row: int, n: int) -> torch.Tensor:
        locs = self.runner.token_to_kv_pool.alloc(n)
        locs = locs[torch.randperm(n, generator=self.gen)]
        self.runner.req_to_token_pool.write(row, self.cached[row], locs)
        self.cached[row] += n
        return locs

    def extend(self, rows: list[int], chunks: list[list[int]], **fb_kwargs) -> LogitsOutput:
        """Append `chunks[i]` to request `rows[i]` in one EXTEND over whatever each row has cached."""
        prefix = [self.cached[r] for r in rows]
        locs = torch.cat([self._alloc(r, len(c)) for r, c in zip(rows, chunks)])
        positions = [p for start, c in zip(prefix, chunks) for p in range(start, start + len(c))]
        seq_lens = [self.cached[r] for r in rows]
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=len(rows),
            input_ids=_i64([t for c in chunks for t in c]), positions=_i64(positions),
            req_pool_indices=_i64(rows), seq_lens=_i64(seq_lens), out_cache_loc=locs,
            seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=[len(c) for c in chunks], **fb_kwargs,
        )
        return self.runner.forward(fb)

    def decode(self, rows: list[int], tokens: list[int]) -> LogitsOutput:
        """One DECODE step: `tokens[i]` is the newest token of request `rows[i]`."""
        locs = torch.cat([self._alloc(r, 1) for r in rows])
        seq_lens = [self.cached[r] for r in rows]
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(rows), input_ids=_i64(tokens),
            positions=_i64([s - 1 for s in seq_lens]), req_pool_indices=_i64(rows),
            seq_lens=_i64(seq_lens), out_cache_loc=locs, seq_lens_cpu=seq_lens,
        )
        return self.runner.forward(fb)
