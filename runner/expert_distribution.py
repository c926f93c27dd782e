"""Expert-distribution recorder and routed-experts capture for mixture-of-experts models.

The recorder follows SGLang's `ExpertDistributionRecorder` surface: `start_record()`,
`stop_record()`, `dump_record(output_dir=None)`. Between start and stop it counts, per layer and per
expert, how many (token, slot) routing choices picked that expert, and `dump_record` returns (and,
given a directory, `torch.save`s as `expert_distribution_recorder_{time}.pt`, as SGLang does):

- mode "stat": `{"rank": 0, "logical_count": [num_layers, num_experts] int64, "num_forward_passes",
  "average_utilization_rate_over_window": None}` accumulated over every forward pass;
- mode "per_pass": `{"records": [{"forward_pass_id", "rank", "num_tokens", "forward_mode",
  "global_physical_count": [num_layers, num_experts]}, ...], "logical_count": their sum,
  "last_physical_to_logical_map": identity}` with one record per forward pass.

Layers are all decoder layers; a dense layer (Qwen3-MoE `mlp_only_layers`) keeps zero counts. There
is no expert parallelism, so physical and logical experts are the same. Dumping resets the record.

Routed-experts capture (`set_capture_routed_experts(True)`) keeps, for the latest forward pass,
`last_routed_experts`: [num_tokens, num_layers, top_k] int32 on the model's device, the expert ids
every token of that pass was routed to (-1 for dense layers), in the batch's token order. Turning it
on does not start a record, and the other way round.

Everything stays on the device: counts are added with `scatter_add_`, nothing is read back until
`dump_record`. Per-pass records cost num_layers * num_experts * 8 bytes each on the device until
dumped. Neither the counting nor the capture costs anything but one attribute read per layer while
both are off. The owner (the model) calls `on_forward_pass_start/end` around each forward and each MoE
layer calls `on_select_experts`; the runner or engine calls the rest. Not thread-safe: start, stop,
dump and the capture flag are meant to be called between forward passes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MODES = ("stat", "per_pass")


class ExpertDistributionRecorder:
    def __init__(self, num_layers: int, num_experts: int, top_k: int, device: torch.device | str,
                 mode: str = "stat") -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.device = torch.device(device)
        self._mode = _check_mode(mode)
        self.recording = False
        self.capture_routed_experts = False
        self.is_active = False  # recording or capturing: the one flag the MoE layers read
        self.last_routed_experts: torch.Tensor | None = None  # [num_tokens, num_layers, top_k] int32
        self._in_pass = False
        self._pass_info: dict = {}
        self._pass_counts: torch.Tensor | None = None  # [num_layers, num_experts], this pass
        self._routed: torch.Tensor | None = None
        self._reset()

    # ---- control (runner / engine) ---------------------------------------------------------
    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        mode = _check_mode(mode)
        if self.recording and mode != self._mode:
            raise RuntimeError(f"cannot switch the expert distribution mode to {mode!r} while recording; "
                               f"call stop_expert_distribution_record() first")
        self._mode = mode

    def start_record(self) -> None:
        """Start a fresh record (anything recorded before and not dumped is dropped)."""
        if self.recording:
            logger.warning("expert distribution recording was already on; restarting it from zero")
        self._reset()
        self.recording = True
        self._update_active()

    def stop_record(self) -> None:
        if not self.recording:
            logger.warning("expert distribution recording was not on; nothing to stop")
        self.recording = False
        self._update_active()

    def dump_record(self, output_dir: str | Path | None = None) -> dict:
        """The record so far (see the module docstring), written into `output_dir` if given; then reset."""
        if self._mode == "stat":
            output = {"rank": 0, "logical_count": self._total.cpu(), "num_forward_passes": self._num_passes,
                      "average_utilization_rate_over_window": None}
            name = f"expert_distribution_recorder_{time.time()}.pt"
        else:
            records = [dict(r, global_physical_count=r["global_physical_count"].cpu()) for r in self._records]
            identity = torch.arange(self.num_experts).expand(self.num_layers, -1).clone()
            output = {"records": records, "logical_count": self._total.cpu(), "last_physical_to_logical_map": identity}
            name = f"expert_distribution_recorder_{time.time()}_0.pt"
        if output_dir is not None:
            directory = Path(output_dir)
            directory.mkdir(parents=True, exist_ok=True)
            torch.save(output, directory / name)
        self._reset()
        return output

    def set_capture_routed_experts(self, enabled: bool) -> None:
        self.capture_routed_experts = bool(enabled)
        if not enabled:
            self.last_routed_experts = None
        self._update_active()

    # ---- hooks (model) ------------------------------------------------------------------------
    def on_forward_pass_start(self, num_tokens: int, forward_mode: int | None = None) -> None:
        self._in_pass = True
        self._pass_info = {"num_tokens": num_tokens, "forward_mode": forward_mode}
        if self.recording:
            if self._mode == "per_pass":
                self._pass_counts = torch.zeros_like(self._total)
            else:
                self._pass_counts = self._total  # stat: count straight into the running total
        if self.capture_routed_experts:
            self._routed = torch.full((num_tokens, self.num_layers, self.top_k), -1, dtype=torch.int32,
                                      device=self.device)

    def on_select_experts(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """topk_ids: [num_tokens, top_k], the experts layer `layer_id` routes each token of this pass to."""
        if not self._in_pass:
            return  # a layer run outside a model forward (nothing to attribute it to)
        if self._pass_counts is not None:
            flat = topk_ids.reshape(-1)
            self._pass_counts[layer_id].scatter_add_(0, flat, torch.ones_like(flat))
        if self._routed is not None:
            self._routed[:, layer_id] = topk_ids

    def on_forward_pass_end(self) -> None:
        if not self._in_pass:
            return
        if self._pass_counts is not None and self._mode == "per_pass":
            self._total += self._pass_counts
            self._records.append({"forward_pass_id": self._num_passes, "rank": 0, **self._pass_info,
                                  "global_physical_count": self._pass_counts})
        if self._pass_counts is not None:
            self._num_passes += 1
        if self._routed is not None:
            self.last_routed_experts = self._routed
        self._in_pass, self._pass_counts, self._routed = False, None, None

    # ---- internals --------------------------------------------------------------------------
    def _reset(self) -> None:
        self._total = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64, device=self.device)
        self._records: list[dict] = []
        self._num_passes = 0

    def _update_active(self) -> None:
        self.is_active = self.recording or self.capture_routed_experts


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"expert distribution mode {mode!r} is not supported; choose one of {MODES}")
    return mode


def recorder_is_active(model) -> bool:
    """Whether `model` has an expert recorder that is recording or capturing right now. A captured
    decode step (graph runners) runs no Python hooks and pads the batch, so it must not replay then."""
    recorder = getattr(model, "expert_recorder", None)
    return recorder is not None and recorder.is_active
