"""ModelRunner: owns the model, the KV pools, the attention backend and the sampler on one device.

`initialize()` runs in the seed document's order: sampler, load_model, configure_kv_cache_dtype,
init_memory_pool, init_attention_backend, init_device_graphs. `forward()` dispatches on the
ForwardMode; `sample()` turns logits into token ids and logprobs. Weight updates, memory release and
resume live here too, because they touch the same tensors. It knows nothing of requests.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from runner import cpu_prepack
from runner.attention import create_attention_backend
from runner.checkpoint import CheckpointError, CheckpointIndex
from runner.config import ModelConfig
from runner.forward_batch import ForwardBatch, LogitsOutput
from runner.kv_pool import ReqToTokenPool, TokenToKVPool
from runner.memory_saver import ALL_TAGS, create_memory_saver
from runner.models import get_model_class
from runner.sampler import SampleOutput, Sampler
from runner.weight_loader import WeightNameMap, WeightUpdateError, apply_plan, plan_weight_load

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RunnerConfig:
    model_path: str
    device: str = "cpu"
    dtype: str = "auto"  # "auto": bf16 on CUDA, fp32 on CPU
    load_format: str = "auto"  # "auto" | "safetensors" | "dummy"
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None
    max_running_requests: int = 512
    context_length: int | None = None
    kv_cache_dtype: str = "auto"
    cpu_kv_cache_bytes: int = 1 << 30
    attention_backend: str | None = None
    disable_cuda_graph: bool = False
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    tp_size: int = 1
    random_seed: int = 0
    cpu_prepack: bool = True  # CPU fp32: oneDNN-prepacked linear weights (runner/cpu_prepack.py)

    def __post_init__(self) -> None:
        if self.tp_size != 1:
            raise ValueError(f"tp_size={self.tp_size}: tensor parallelism is not supported yet; use tp_size=1")
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype={self.dtype!r}: choose 'auto', {', '.join(map(repr, _DTYPES))}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format={self.load_format!r}: choose 'auto', 'safetensors' or 'dummy'")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens={self.max_total_tokens} must be >= 1")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests={self.max_running_requests} must be >= 1")
        if self.kv_cache_dtype not in ("auto", *_DTYPES):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: choose 'auto' or {', '.join(_DTYPES)}")


class ModelRunner:
    def __init__(self, config: RunnerConfig) -> None:
        self.server_config = config
        self.model_config = ModelConfig.from_pretrained(config.model_path)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available; use device='cpu'")
        if config.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = _DTYPES[config.dtype]
        ctx = self.model_config.context_len
        if config.context_length is not None:
            if config.context_length > ctx:
                raise ValueError(f"context_length={config.context_length} exceeds the model's {ctx}")
            ctx = config.context_length
        self.context_len = ctx
        self.memory_saver = create_memory_saver(config.enable_memory_saver, self.device)
        self.weights_valid = True
        self.invalid_weights: set[str] = set()
        self.initialize()

    # ---- initialisation, in the seed's order ------------------------------------------------
    def initialize(self) -> None:
        self.sampler = Sampler()
        self.load_model()
        self.configure_kv_cache_dtype()
        self.init_memory_pool()
        self.init_attention_backend()
        self.init_device_graphs()

    def load_model(self) -> None:
        cfg = self.server_config
        torch.manual_seed(cfg.random_seed)
        with self.memory_saver.region("weights", enable_cpu_backup=cfg.enable_weights_cpu_backup):
            with torch.device(self.device):
                model = get_model_class(self.model_config)(self.model_config)
            model.to(self.dtype)
            self.model = model.eval()
            self.name_map = WeightNameMap(self.model)
            if cfg.load_format == "dummy":
                self._init_dummy_weights()
            else:
                self._load_from_disk(Path(cfg.model_path), check_finite=False)
            self.memory_saver.track("weights", list(self.name_map.params.values()))
        self.use_prepack = cfg.cpu_prepack and cpu_prepack.is_supported(self.device, self.dtype)
        self._modules_of_param: dict[int, list] = {}
        for m in cpu_prepack.packable_modules(self.model):
            for p in (m.weight, getattr(m, "bias", None)):
                if p is not None:
                    self._modules_of_param.setdefault(id(p), []).append(m)
        self._repack(None)

    def _repack(self, hf_names: set[str] | None) -> None:
        """Refresh the prepacked shadows of the modules whose weights `hf_names` touched (None = all)."""
        if not self.use_prepack:
            return
        if hf_names is None:
            modules = cpu_prepack.packable_modules(self.model)
        else:
            ids = {id(self.name_map.resolve(n).param) for n in hf_names}
            modules = list({id(m): m for i in ids for m in self._modules_of_param.get(i, [])}.values())
        for m in modules:
            cpu_prepack.pack(m)

    def _drop_packs(self) -> None:
        for m in cpu_prepack.packable_modules(self.model):
            cpu_prepack.unpack(m)

    def _init_dummy_weights(self) -> None:
        gen = torch.Generator().manual_seed(self.server_config.random_seed)
        with torch.no_grad():
            for name, p in self.name_map.params.items():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    def _load_from_disk(self, path: Path, check_finite: bool) -> set[str]:
        index = CheckpointIndex(path)
        self._check_checkpoint_header(index)
        # Pass 1 reads and validates every tensor; pass 2 (page cache warm) writes. The model is
        # touched only after the whole checkpoint proved good, without holding a second copy.
        if check_finite:
            for name, tensor in index.iter_tensors():
                plan_weight_load(self.name_map, [(name, tensor)], source=str(index.entries[name].file))
        loaded = set()
        for name, tensor in index.iter_tensors():
            plan = plan_weight_load(self.name_map, [(name, tensor)], str(index.entries[name].file), False)
            loaded |= apply_plan(plan)
        return loaded

    def _check_checkpoint_header(self, index: CheckpointIndex) -> None:
        """Names, shapes and dtypes from the safetensors headers, before any data is read."""
        for name, entry in index.entries.items():
            if self.name_map.is_ignored(name):
                continue
            try:
                target = self.name_map.resolve(name)
            except WeightUpdateError as e:
                raise WeightUpdateError(f"{entry.file}: {e}") from None
            if tuple(target.view().shape) != entry.shape:
                raise WeightUpdateError(f"{entry.file}: tensor {name!r} has shape {entry.shape}, the model "
                                        f"expects {tuple(target.view().shape)}")
            if not entry.dtype.is_floating_point:
                raise WeightUpdateError(f"{entry.file}: tensor {name!r} has non-float dtype {entry.dtype}")
        missing = [n for n in self.name_map.hf_names() if n not in index.entries]
        if missing:
            raise WeightUpdateError(f"{index.root}: checkpoint is missing {len(missing)} tensors, e.g. {missing[0]!r}")

    def configure_kv_cache_dtype(self) -> None:
        kv = self.server_config.kv_cache_dtype
        self.kv_cache_dtype = self.dtype if kv == "auto" else _DTYPES[kv]

    def _profile_max_num_tokens(self) -> int:
        cfg, mc = self.server_config, self.model_config
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
            self.req_to_token_pool = ReqToTokenPool(self.server_config.max_running_requests, self.context_len + 1,
                                                    self.device)
            self.token_to_kv_pool = TokenToKVPool(self.max_total_num_tokens, self.kv_cache_dtype,
                                                  mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                                  self.device)
            self.memory_saver.track("kv_cache", self.token_to_kv_pool.buffers())

    def init_attention_backend(self) -> None:
        self.attn_backend = create_attention_backend(self.server_config.attention_backend, self.device,
                                                     self.model_config, self)

    def init_device_graphs(self) -> None:
        # CUDA-graph decode is the GPU issue's; on the CPU there is nothing to capture.
        self.graph_runner = None

    # ---- the hot path --------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, fb: ForwardBatch) -> LogitsOutput | None:
        if fb.forward_mode.is_idle():
            return None
        if not self.weights_valid:
            raise RuntimeError(self.invalid_weights_message())
        if not (self.memory_saver.is_resident("weights") and self.memory_saver.is_resident("kv_cache")):
            # Freed storages would be read (or written) out of bounds.
            raise RuntimeError("memory is released: call resume_memory_occupation() before running the model")
        fb.attn_backend = self.attn_backend
        fb.token_to_kv_pool = self.token_to_kv_pool
        fb.req_to_token_pool = self.req_to_token_pool
        self.attn_backend.init_forward_metadata(fb)
        return self.model(fb.input_ids, fb.positions, fb)

    @torch.no_grad()
    def sample(self, logits_output: LogitsOutput, fb: ForwardBatch) -> SampleOutput:
        return self.sampler(logits_output.next_token_logits, fb.sampling_info)

    def invalid_weights_message(self) -> str:
        some = sorted(self.invalid_weights)[:3]
        resume = "" if self.memory_saver.is_resident("weights") else "resume_memory_occupation(['weights']), then "
        return (f"weights were released without CPU backup and {len(self.invalid_weights)} tensors have not "
                f"been reloaded since (e.g. {some}); call {resume}update_weights_from_tensor/_from_disk with the "
                f"full model, or create the engine with enable_weights_cpu_backup=True")

    # ---- weights ---------------------------------------------------------------------------
    def _require_weights_resident(self) -> None:
        if not self.memory_saver.is_resident("weights"):
            raise WeightUpdateError("weights are released; call resume_memory_occupation(['weights']) first")

    def update_weights_from_tensor(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Atomic: all tensors are checked before the first is written. Returns how many were loaded."""
        self._require_weights_resident()
        plan = plan_weight_load(self.name_map, list(named_tensors))
        try:
            loaded = apply_plan(plan)
        finally:  # even a write that failed half-way must not leave stale packed copies behind
            self._repack({t.hf_name for t, _ in plan})
        self._mark_loaded(loaded)
        return len(loaded)

    def update_weights_from_disk(self, model_path: str | Path) -> int:
        self._require_weights_resident()
        path = Path(model_path)
        if not path.is_dir():
            raise WeightUpdateError(f"checkpoint directory {path} does not exist")
        try:
            other = ModelConfig.from_pretrained(path)
        except (FileNotFoundError, ValueError, KeyError, TypeError) as e:  # KeyError: a required key is missing
            raise WeightUpdateError(f"{path / 'config.json'}: {type(e).__name__}: {e}") from None
        mine, theirs = self.model_config.shape_signature(), other.shape_signature()
        diff = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
        if diff:
            raise WeightUpdateError(f"{path / 'config.json'}: does not match the running model: "
                                    + ", ".join(f"{k} {a!r} != {b!r}" for k, (a, b) in diff.items()))
        try:
            loaded = self._load_from_disk(path, check_finite=True)
        except CheckpointError as e:
            self._repack(None)  # pass 2 may have written some tensors before failing
            raise WeightUpdateError(str(e)) from None
        self._repack(loaded)
        self._mark_loaded(loaded)
        return len(loaded)

    def _mark_loaded(self, hf_names: set[str]) -> None:
        if self.invalid_weights:
            self.invalid_weights -= hf_names
            self.weights_valid = not self.invalid_weights

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        self._require_weights_resident()
        if name in self.invalid_weights:
            raise WeightUpdateError(f"weight {name!r} was released without CPU backup and not reloaded since")
        view = self.name_map.resolve(name).view()
        return view.reshape(-1)[:truncate_size].float().cpu().tolist() if view.dim() == 1 else \
            view[: max(1, truncate_size)].float().cpu().tolist()

    # ---- memory release / resume ----------------------------------------------------------
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        tags = _check_tags(tags)
        for tag in tags:
            if not self.memory_saver.is_resident(tag):
                continue
            self.memory_saver.pause(tag)  # first: a refusal (saver disabled) must leave everything as it was
            if tag == "weights":
                self._drop_packs()  # shadows of the weights go with them
            if tag == "kv_cache":
                self.token_to_kv_pool.clear()
            if tag == "weights" and not self.memory_saver.has_cpu_backup("weights"):
                self.weights_valid = False
                self.invalid_weights = set(self.name_map.hf_names())

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        for tag in _check_tags(tags):
            was_resident = self.memory_saver.is_resident(tag)
            self.memory_saver.resume(tag)
            if tag == "kv_cache" and not was_resident:
                # Resumed memory holds whatever was there before (NaN included). Attention reads the
                # padding slot 0 for masked positions, and 0 * NaN would poison the real ones.
                pool = self.token_to_kv_pool
                pool.k_buffer[:, 0].zero_()
                pool.v_buffer[:, 0].zero_()
            if tag == "weights" and not was_resident and self.memory_saver.has_cpu_backup("weights"):
                self._repack(None)  # without backup, shadows come back module by module with updates

    def shutdown(self) -> None:
        self.memory_saver.close()


def _check_tags(tags: list[str] | None) -> list[str]:
    if tags is None:
        return list(ALL_TAGS)
    if isinstance(tags, str):
        tags = [tags]
    bad = [t for t in tags if t not in ALL_TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; valid tags: {list(ALL_TAGS)}")
    return list(tags)


