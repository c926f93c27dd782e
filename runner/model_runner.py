"""ModelRunner: owns the model, the KV pools, the attention backend and the sampler on one device.

The hub of runner/. `initialize()` runs in the seed document's order: sampler, load_model,
configure_kv_cache_dtype, init_memory_pool, init_attention_backend, init_device_graphs. `forward()`
dispatches on the ForwardMode (a captured decode step when the graph runner can take the batch, else
eager); `sample()` turns logits into token ids and logprobs.

Everything else is a thin call into the folder of its concern, kept here as methods because users,
the Engine and the tensor-parallel runner call them on the runner:
- weights (runner/weights/): every update route (tensor, bucket, direct, custom, disk, delta) ends in the one
  all-or-nothing writer (routes.py, loader.py); distributed updates are received through the
  update-group registry (update_groups.py). A write that fails half-way is undone; if undoing fails,
  the weights are marked invalid and forward() refuses.
- memory (runner/memory/): release/resume per tag and the final free at shutdown (occupation.py).
It knows nothing of requests: pausing, cache flushes and versions are the caller's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from runner import batch_invariant, cpu_kernels, hf_numerics
from runner.attention import create_attention_backend
from runner.config import MODEL_DTYPES, ModelConfig, RunnerConfig
from runner.forward_batch import DeferredLogits, ForwardBatch, ForwardContext, LogitsOutput, forward_context
from runner.layers import prepack
from runner.layers.embedding import LMHead
from runner.layers.norm import RMSNorm
from runner.layers.rotary import RotaryEmbedding
from runner.memory import occupation
from runner.memory.kv_pool import ReqToTokenPool, TokenToKVPool
from runner.memory.memory_saver import create_memory_saver
from runner.models import fused_layer, get_model_class
from runner.sampler import SampleOutput, Sampler, plain_rows
from runner.weights import routes
from runner.weights.checkpoint import CheckpointIndex
from runner.weights.delta import WeightHashes
from runner.weights.loader import WeightNameMap, WeightWriter
from runner.weights.same_gpu import explain_nccl_error
from runner.weights.update_groups import UpdateGroupRegistry

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner", "RunnerConfig"]  # RunnerConfig lives in runner.config


class ModelRunner:
    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model_path)
        if config.rl_on_policy_target == "fsdp" and self.model_config.architecture == "Qwen3MoeForCausalLM":
            # HF's Qwen3-MoE rounds the routing weights to the model dtype and sums the experts there; this
            # runner keeps them in fp32 (as HF's Mixtral does), so the promise of bitwise logprobs would not hold.
            raise ValueError("rl_on_policy_target='fsdp' is not supported for Qwen3MoeForCausalLM (its routing "
                             "weights are not rounded as transformers rounds them, so logprobs would not be "
                             "bitwise HF's); supported: the dense architectures and MixtralForCausalLM")
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available; use device='cpu'")
        if self.device.type == "cuda":
            # Make it the current device: torch_memory_saver keys its pools by the current device, and
            # kernels launched without an explicit device (flashinfer's workspace, graphs) go there.
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        if config.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = MODEL_DTYPES[config.dtype]
        ctx = self.model_config.context_len
        if config.context_length is not None:
            if config.context_length > ctx:
                raise ValueError(f"context_length={config.context_length} exceeds the model's {ctx}")
            ctx = config.context_length
        self.context_len = ctx
        self.memory_saver = create_memory_saver(config.enable_memory_saver, self.device)
        self.weights_valid = True
        self.invalid_weights: set[str] = set()
        self.invalid_reason = ""
        self.update_groups = UpdateGroupRegistry()  # broadcast groups joined for distributed updates
        self.weight_hashes = WeightHashes()  # per-tensor checksums a delta's base is checked against
        self.custom_loaders = routes.import_custom_loaders(config.custom_weight_loader)
        self.is_shut_down = False
        self.piecewise_runner = None  # prefill graphs (CUDA, enable_piecewise_cuda_graph); set by init_device_graphs
        self.initialize()

    @property
    def server_config(self) -> RunnerConfig:
        """Old name of `config`, still read by init_device_graphs (another owner's method)."""
        return self.config

    # ---- initialisation, in the seed's order ------------------------------------------------
    def initialize(self) -> None:
        self.sampler = Sampler()
        self.load_model()
        self.init_lora_manager()
        self.configure_kv_cache_dtype()
        self.init_memory_pool()
        self.init_attention_backend()
        self.init_device_graphs()

    def load_model(self) -> None:
        cfg = self.config
        torch.manual_seed(0 if cfg.random_seed is None else cfg.random_seed)
        with self.memory_saver.region("weights", enable_cpu_backup=cfg.enable_weights_cpu_backup):
            with torch.device(self.device):
                model = get_model_class(self.model_config)(self.model_config)
            model.to(self.dtype)
            self.model = model.eval()
            self.name_map = WeightNameMap(self.model)
            if cfg.load_format == "dummy":
                self._init_dummy_weights()
            else:
                with CheckpointIndex(cfg.model_path) as index:
                    routes.load_checkpoint(self, index, WeightWriter(snapshot=False), check=False)
            self.memory_saver.track("weights", list(self.name_map.params.values()))
        cpu_ops = cpu_kernels.enabled(cfg.cpu_kernels, self.device)  # fused CPU RMSNorm and rotary, or None
        for m in self.model.modules():
            if isinstance(m, LMHead):
                m.fp32 = cfg.enable_fp32_lm_head
            elif isinstance(m, (RMSNorm, RotaryEmbedding)):
                m.cpu_ops = cpu_ops
        fused_layer.enable(self.model, cpu_ops)  # decoder layers, or the whole forward, as one op where they fit
        # The plain sampling path as one op (runner/csrc/sampler.cpp), called directly (runner/csrc/direct.cpp).
        self.sampler.cpu_ops = cpu_kernels.direct() if cpu_ops is not None else None
        self.sampler.exact_greedy_logprobs = cfg.enable_deterministic_inference
        self.use_prepack = cfg.cpu_prepack and prepack.is_supported(self.device, self.dtype)
        self._modules_of_param: dict[int, list] = {}
        for m in prepack.packable_modules(self.model):
            for p in (m.weight, getattr(m, "bias", None)):
                if p is not None:
                    self._modules_of_param.setdefault(id(p), []).append(m)
        self._repack(None)

    def init_lora_manager(self) -> None:
        """enable_lora: adapter slots on every adapted projection (runner/lora/), then lora_paths loaded."""
        self.lora_manager = None
        if not self.config.enable_lora:
            return
        from runner.lora.manager import LoRAManager

        self.lora_manager = LoRAManager(self)
        self.load_initial_lora_adapters()

    def load_initial_lora_adapters(self) -> None:
        """lora_paths (a tensor-parallel engine loads them from rank 0 instead, so every rank agrees on uids)."""
        for src in self.config.lora_paths or ():
            self.lora_manager.load(src["lora_name"], src["lora_path"], pinned=src["pinned"])

    def _repack(self, hf_names: set[str] | None) -> None:
        """Refresh the prepacked shadows of the modules whose weights `hf_names` touched (None = all)."""
        if not self.use_prepack:
            return
        if hf_names is None:
            modules = prepack.packable_modules(self.model)
        else:
            ids = {id(self.name_map.resolve(n).param) for n in hf_names}
            modules = list({id(m): m for i in ids for m in self._modules_of_param.get(i, [])}.values())
        for m in modules:
            prepack.pack(m)

    def _drop_packs(self) -> None:
        for m in prepack.packable_modules(self.model):
            prepack.unpack(m)

    def _init_dummy_weights(self) -> None:
        # Drawn where the parameter lives, in its dtype: no fp32 host copy of a 7B model first.
        seed = 0 if self.config.random_seed is None else self.config.random_seed  # the same weights every start
        gen = torch.Generator(device=self.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.name_map.params.items():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)

    def configure_kv_cache_dtype(self) -> None:
        kv = self.config.kv_cache_dtype
        self.kv_cache_dtype = self.dtype if kv == "auto" else MODEL_DTYPES[kv]

    def _profile_max_num_tokens(self) -> int:
        cfg, mc = self.config, self.model_config
        per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * self.kv_cache_dtype.itemsize
        if cfg.max_total_tokens is not None:
            return cfg.max_total_tokens
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - cfg.mem_fraction_static)
            if budget <= per_token * self.context_len:
                raise ValueError(f"not enough GPU memory for the KV cache ({budget / 2**30:.2f} GiB left at "
                                 f"mem_fraction_static={cfg.mem_fraction_static}); raise it")
            return int(budget // per_token)
        return max(self.context_len, int(cfg.cpu_kv_cache_bytes // per_token))

    def init_memory_pool(self) -> None:
        mc = self.model_config
        self.max_total_num_tokens = self._profile_max_num_tokens()
        with self.memory_saver.region("kv_cache"):
            self.req_to_token_pool = ReqToTokenPool(self.config.max_running_requests, self.context_len + 1,
                                                    self.device)
            self.token_to_kv_pool = TokenToKVPool(self.max_total_num_tokens, self.kv_cache_dtype,
                                                  mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                                  self.device)
            self.memory_saver.track("kv_cache", self.token_to_kv_pool.buffers())

    def init_attention_backend(self) -> None:
        self.attn_backend = create_attention_backend(self.config.attention_backend, self.device,
                                                     self.model_config, self)

    def init_device_graphs(self) -> None:
        """Build the captured-decode runner (runner/graphs/graph_runner.py) unless disable_cuda_graph:
        CUDA graphs on CUDA, the compiled static-shape decode step on the CPU."""
        self.graph_runner = None
        self.piecewise_runner = None
        if self.device.type == "cuda" and self.config.enable_piecewise_cuda_graph:
            from runner.graphs.piecewise_runner import PiecewiseExtendRunner  # GPU path only

            pw = PiecewiseExtendRunner(self)
            if pw.supports_model():
                pw.capture()
                self.piecewise_runner = pw
            else:
                logger.info("piecewise CUDA graphs: %s is not supported; prefill runs eagerly",
                            type(self.model).__name__)
        if self.config.disable_cuda_graph:
            return
        if self.device.type == "cuda":
            from runner.graphs.cuda_graph_runner import (
                CudaGraphRunner,  # the GPU path only; never imported on CPU
            )
            from runner.layers.moe import decode_graph_blocker

            blocker = decode_graph_blocker(self.model, self.dtype, torch.cuda.get_device_capability(self.device),
                                           self.config.enable_deterministic_inference)
            if blocker is not None:
                logger.warning("CUDA graphs off: decode runs eagerly because %s", blocker)
                return
            self.graph_runner = CudaGraphRunner(self, capture_sizes=self.config.cuda_graph_bs)
        elif self.device.type == "cpu" and self.config.cuda_graph_bs:
            # Opt-in on the CPU: compiling costs seconds to minutes per size, measured gains were small
            # (0.92x eager on a 40M model, slower on tiny ones), and a step compiled mid-run rounds
            # differently from the eager one by an ulp, so results must not switch paths silently.
            from runner.graphs.cpu_graph_runner import CpuGraphRunner

            self.graph_runner = CpuGraphRunner(self)

    # ---- the hot path --------------------------------------------------------------------
    def prepare_forward(self, fb: ForwardBatch) -> tuple | None:
        """The arguments of the fused whole-model op for `fb` (runner/models/fused_layer.py FusedModel), made
        on the calling thread without touching the attention backend's plan, or None where `forward` takes
        another path (no fused model, LoRA, captured graphs). The overlap schedule prepares step N+1 on its
        scheduler thread while step N runs; `forward(fb, prepared)` then only checks and runs it."""
        fm = getattr(self.model, "fused_model", None)
        if (fm is None or fb.forward_mode.is_idle() or self.lora_manager is not None or self.graph_runner is not None
                or self.piecewise_runner is not None):
            return None
        return fm.args(fb, self.token_to_kv_pool, self.attn_backend)

    @torch.no_grad()
    def forward(self, fb: ForwardBatch, prepared: tuple | None = None) -> LogitsOutput | None:
        if fb.forward_mode.is_idle():
            return None
        self._check_runnable()
        if prepared is None:
            prepared = self.prepare_forward(fb)
        if prepared is not None and self.model.fused_model is not None:  # (turned off since it was prepared?)
            # The whole forward as one op (runner/models/fused_layer.py): bitwise the eager path's logits.
            try:
                with torch.inference_mode():
                    return LogitsOutput(self.model.fused_model.run(prepared))
            except Exception as e:  # noqa: BLE001 - a defect of the fused path must not fail the step
                self._turn_off_fused(e)
        lora_batch = self.lora_manager.prepare(fb) if self.lora_manager is not None else None
        # While the cuda_graph tag is released CUDA graph memory is unmapped (torch_memory_saver in preload
        # mode) or dropped: replaying would fault, so those steps run eagerly until it is resumed. The
        # compiled CPU step holds no such memory and keeps running (its numerics must not switch).
        # Captured steps hold no adapter: batches with LoRA run eager.
        graphs_resident = self.memory_saver.is_resident("cuda_graph")
        gr = self.graph_runner
        if (fb.forward_mode.is_decode() and gr is not None and lora_batch is None
                and (graphs_resident or not getattr(gr, "released_with_cuda_graph_tag", False)) and gr.can_run(fb)):
            return gr.replay(fb)
        pw = self.piecewise_runner
        if (fb.forward_mode.is_extend() and pw is not None and lora_batch is None and graphs_resident
                and pw.can_run(fb)):
            return pw.replay(fb)
        # The eager step runs in inference mode: no version counters or view tracking, ~6% of a tiny
        # model's step. Not the captured one above: compiled graphs guard on the autograd mode.
        with (torch.inference_mode(),
              forward_context(ForwardContext(self.attn_backend, self.token_to_kv_pool, self.req_to_token_pool,
                                             lora_batch)),
              batch_invariant.mode(self.config.enable_deterministic_inference),
              hf_numerics.mode(self.config.rl_on_policy_target == "fsdp")):
            self.attn_backend.init_forward_metadata(fb)
            return self.model(fb.input_ids, fb.positions, fb)

    def _turn_off_fused(self, e: Exception) -> None:
        """The fused forward raised. It only repeats the modules' ops, so anything it cannot run is its own
        defect: turn it off, say so once, and let the modules run this step and the next (they rewrite the same
        KV slots)."""
        logger.warning("the fused CPU forward failed (%s: %s); using the modules' forward from now on",
                       type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
        self.model.fused_model = None

    def _check_runnable(self) -> None:
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)  # the current device is per thread (the scheduler's is not ours)
        if not self.weights_valid:
            raise RuntimeError(self.invalid_weights_message())
        if not (self.memory_saver.is_resident("weights") and self.memory_saver.is_resident("kv_cache")):
            # Freed storages would be read (or written) out of bounds.
            raise RuntimeError("memory is released: call resume_memory_occupation() before running the model")

    @torch.no_grad()
    def forward_sample(self, fb: ForwardBatch, prepared: tuple, fill_from: torch.Tensor | None = None,
                       fill_index: torch.Tensor | None = None) -> tuple[DeferredLogits, SampleOutput] | None:
        """`forward(fb, prepared)` then `sample`, as one C++ call that takes the GIL once (FusedModel.run_sample),
        fb.input_ids first set to fill_from (rows fill_index of it, when given): the overlap schedule's decode
        step on its worker. The same functions on the same tensors, so the same logits, ids and logprobs (the
        logits' fp32 copy made only if read: DeferredLogits).
        None, having done nothing, where the sampler's plain path does not apply or the fused forward is
        off: the caller then fills and runs `forward` and `sample` itself."""
        fm = getattr(self.model, "fused_model", None)
        info = fb.sampling_info
        if fm is None or self.sampler.cpu_ops is None or info is None or not plain_rows(fb.batch_size, info):
            return None
        self._check_runnable()
        try:
            with torch.inference_mode():
                logits, ids, logprobs = fm.run_sample(prepared, fill_from, fill_index, info)
        except Exception as e:  # noqa: BLE001 - as in forward: the modules' path runs this step and the next
            self._turn_off_fused(e)
            return None
        return DeferredLogits(logits), SampleOutput(ids, logprobs if info.need_logprobs else None)

    @torch.no_grad()
    def forward_sample_steps(self, fb: ForwardBatch, prepared: tuple, out_cache_locs: torch.Tensor,
                             stop_flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """len(out_cache_locs) decode steps of the decode batch fb in one C++ call (the scheduler's decode block,
        rollout/scheduler.py): step j samples output position steps + j of each row from step j - 1's ids,
        its KV in out_cache_locs[j] ([num_steps, bs], already in the request table); no step after the first
        starts once `stop_flag` (int32 [1]) is set. Bitwise the ids and logprobs of as many forward_sample
        calls. -> (ids [done, bs], logprobs [done, bs] or None) for the `done` >= 1 steps run,
        or None, having done nothing, where forward_sample would return None (the caller steps one at a time)."""
        fm = getattr(self.model, "fused_model", None)
        info = fb.sampling_info
        if (fm is None or prepared is None or self.sampler.cpu_ops is None or info is None
                or not fb.forward_mode.is_decode() or not plain_rows(fb.batch_size, info)
                or not hasattr(fm.direct, "model_forward_sample_steps")):
            return None
        self._check_runnable()
        try:
            with torch.inference_mode():
                ids, logprobs = fm.run_sample_steps(prepared, out_cache_locs, info, stop_flag)
        except Exception as e:  # noqa: BLE001 - as in forward: the modules' path runs from now on
            self._turn_off_fused(e)
            return None
        return ids, logprobs if info.need_logprobs else None

    @torch.no_grad()
    def sample(self, logits_output: LogitsOutput, fb: ForwardBatch) -> SampleOutput:
        return self.sampler(logits_output.next_token_logits, fb.sampling_info)

    def invalid_weights_message(self) -> str:
        if self.invalid_reason:
            return (f"weights are invalid: {self.invalid_reason}; load a full set of weights "
                    f"(update_weights_from_tensor/_from_disk) before generating")
        some = sorted(self.invalid_weights)[:3]
        resume = "" if self.memory_saver.is_resident("weights") else "resume_memory_occupation(['weights']), then "
        return (f"weights were released without CPU backup and {len(self.invalid_weights)} tensors have not "
                f"been reloaded since (e.g. {some}); call {resume}update_weights_from_tensor/_from_disk with the "
                f"full model, or create the engine with enable_weights_cpu_backup=True")

    # ---- weights (runner/weights/): every route ends in routes.write ------------------------
    def _require_weights_resident(self) -> None:
        routes.require_weights_resident(self)

    def new_weight_writer(self) -> WeightWriter:
        """The writer of one update (a tensor-parallel rank's votes before it commits)."""
        return WeightWriter(snapshot=True)

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None) -> int:
        """(HF name, tensor) pairs or a dict; load_format="flattened_bucket": a bucket dict
        {"flattened_tensor", "metadata"} (or a list of them); "direct": (runner parameter name, whole
        tensor) pairs; one of `custom_weight_loader`: handed to that function. All but the last are
        checked before the first is written. Returns how many tensors were written."""
        return routes.update_from_tensor(self, named_tensors, load_format)

    def open_checkpoint(self, model_path: str | Path) -> CheckpointIndex:
        """Open (headers, config check, mappings) a checkpoint for update_weights_from_disk. It touches no
        runner state, so a caller runs it without its locks: a slow disk stalls only that call."""
        return routes.open_checkpoint(self, model_path)

    def update_weights_from_disk(self, model_path: str | Path | CheckpointIndex) -> int:
        """Load a whole HF checkpoint directory (or one open_checkpoint opened), read as one snapshot
        (see runner/weights/checkpoint.py)."""
        return routes.update_from_disk(self, model_path)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str | None = None, timeout_s: float = 120.0) -> None:
        """Join a trainer's broadcast group as rank `rank_offset` (the trainer is rank 0).
        backend None: nccl on CUDA, gloo otherwise."""
        if backend is None:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        try:
            self.update_groups.join(master_address, master_port, rank_offset, world_size, group_name, backend,
                                    timeout_s)
        except Exception as e:
            better = explain_nccl_error(e, self.device, group_name)
            if better is None:
                raise
            raise better from e

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, load_format: str | None = None,
                                        load: Callable[[list], int] | None = None) -> int:
        """Receive one bucket broadcast by rank 0 of `group_name` into a staging buffer, then load it.

        Receives on one group are serialised (the collectives must pair up in order); nothing else is
        held while waiting for the sender. `load(named_tensors)` does the load, by default
        `update_weights_from_tensor`; a caller passes its own to take its locks only once the bytes
        are in. `load_format` is the wire format (weight_sync.distributed: None = one broadcast per
        tensor, SGLang's default). A failed or timed-out receive writes nothing.
        """
        try:
            return self.update_groups.receive(group_name, names, dtypes, shapes, self.device, load_format,
                                              load or self.update_weights_from_tensor)
        except Exception as e:  # NCCL builds its communicator at the first collective: it refuses here
            better = explain_nccl_error(e, self.device, group_name)
            if better is None:
                raise
            raise better from e

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave `group_name` and free the name; waits for a receive in progress on it to end."""
        self.update_groups.destroy(group_name)

    def get_weights_by_name(self, name: str, truncate_size: int = 100, max_values: int | None = None) -> list:
        """The first `truncate_size` rows (elements for 1-D) of an HF-named weight; a tied
        lm_head.weight reads as the embedding it shares. max_values: refuse (ValueError) more values."""
        return routes.get_weights_by_name(self, name, truncate_size, max_values)

    # ---- LoRA adapters (runner/lora/) ----------------------------------------------------------
    def _require_lora(self):
        if self.lora_manager is None:
            raise ValueError("LoRA is off: create the engine with enable_lora=True (and max_lora_rank, "
                             "lora_target_modules, or lora_paths)")
        return self.lora_manager

    def load_lora_adapter(self, lora_name: str, lora_path: str | None = None, tensors=None,
                          config_dict: dict | None = None, load_format: str | None = None,
                          pinned: bool = False, uid: int | None = None) -> int:
        """Load a PEFT adapter from a directory or from (tensors, config_dict); load_format None (a dict or
        pairs of PEFT names) or "flattened_bucket". Everything is checked before a byte is written; returns
        the adapter's uid (`uid`: the one to register it under, a tensor-parallel rank's from rank 0)."""
        staged = self.stage_lora_adapter(lora_name, lora_path, tensors, config_dict, load_format, pinned)
        return self.commit_lora_adapter(staged, uid)

    def stage_lora_adapter(self, lora_name: str, lora_path: str | None = None, tensors=None,
                           config_dict: dict | None = None, load_format: str | None = None, pinned: bool = False):
        """Every check of a load and its host buffers (runner/lora/manager.py StagedAdapter); writes nothing."""
        manager = self._require_lora()
        if tensors is not None:
            pairs = routes.unpack_named_tensors(tensors, load_format)
            names = [n for n, _ in pairs]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"adapter tensors {dup[:3]} given more than once")
            tensors = dict(pairs)
        elif lora_path is None:
            raise ValueError("load_lora_adapter needs lora_path or tensors")
        return manager.stage(lora_name, lora_path, tensors, config_dict, pinned)

    def commit_lora_adapter(self, staged, uid: int | None = None) -> int:
        manager = self._require_lora()
        manager.check_commit(staged)
        self.before_lora_commit()
        return manager.commit(staged, uid).uid

    def unload_lora_adapter(self, lora_name: str) -> None:
        manager = self._require_lora()
        manager.check_unload(lora_name)
        self.before_lora_commit()
        manager.unload(lora_name)

    def before_lora_commit(self) -> None:
        """Called once a LoRA load or unload is checked, before it changes anything (a tensor-parallel rank
        votes here and raises if another rank refused)."""

    def lora_adapters(self) -> dict[str, dict]:
        """name -> {"uid", "path", "pinned", "r"} of every loaded adapter ({} with LoRA off)."""
        if self.lora_manager is None:
            return {}
        return {a.name: {"uid": a.uid, "path": a.path, "pinned": a.pinned, "r": a.config.r}
                for a in self.lora_manager.adapters.values()}

    # ---- memory (runner/memory/): release / resume / shutdown ---------------------------------
    def check_memory_transition(self, tags: list[str] | None, release: bool) -> list[str]:
        """The tags a release (or resume) of `tags` acts on; RuntimeError, naming them, if any is already
        released (or still resident). None or [] means every tag, as in SGLang."""
        return occupation.check_transition(self, tags, release)

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Release `tags` (None: all). Each must be resident (checked before anything is released)."""
        if not self.config.enable_weights_cpu_backup:  # released weights may come back with other bits
            self.weight_hashes.invalidate()
        occupation.release(self, tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Resume `tags` (None: all). Each must be released (checked before anything is resumed)."""
        occupation.resume(self, tags)

    def shutdown(self) -> None:
        """Leave every weight-update group and free every tensor this runner holds. Storages are
        freed in place (not just dereferenced), so the memory goes back even while a caller still
        holds the model, the runner or the Engine. The runner is unusable afterwards. Idempotent."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        self.update_groups.destroy_all()
        occupation.free_all(self)
