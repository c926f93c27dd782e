"""ModelRunner: owns the model, the KV pools, the attention backend and the sampler on one device.

`initialize()` runs in the seed document's order: sampler, load_model, configure_kv_cache_dtype,
init_memory_pool, init_attention_backend, init_device_graphs. `forward()` dispatches on the
ForwardMode; `sample()` turns logits into token ids and logprobs. Memory release and resume live here
too, because they touch the same tensors.

Weights enter the model here and nowhere else: `update_weights_from_tensor` (pairs or flattened
buckets, unpacked here), `update_weights_from_disk` (one snapshot of the checkpoint directory) and
`update_weights_from_distributed` (received from a broadcast group whose registry lives here) all end
in the same check-everything-then-write-all-or-nothing loader (runner/weight_loader.py). A write that
fails half-way is undone; if undoing fails, the weights are marked invalid and forward() refuses. It
knows nothing of requests: pausing, cache flushes and versions are the caller's. SGLang's other tensor
formats land here too: load_format="direct" (runner parameter names, whole tensors, checked the same
way) and a `custom_weight_loader` path (a function fn(model, named_tensors) allowed at construction,
run with every parameter snapshotted first so a failure or a non-finite result is undone).

Release and resume follow SGLang's state machine per tag: releasing a released tag, or resuming a
resident one, is a RuntimeError (a tag that holds nothing, like cuda_graph on the CPU, moves the same
way). `shutdown()` frees every tensor the runner holds (weights, KV, graph buffers, prepacked copies,
host backups), so the memory goes back even while something still references the runner.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from runner import batch_invariant, cpu_prepack
from runner.attention import create_attention_backend
from runner.checkpoint import CheckpointError, CheckpointIndex
from runner.config import MODEL_DTYPES, ModelConfig, RunnerConfig, check_memory_tags
from runner.forward_batch import ForwardBatch, ForwardContext, LogitsOutput, forward_context
from runner.kv_pool import ReqToTokenPool, TokenToKVPool
from runner.memory_saver import create_memory_saver, release_host_memory
from runner.models import get_model_class
from runner.sampler import SampleOutput, Sampler
from runner.weight_loader import (
    WeightNameMap,
    WeightPlan,
    WeightsCorruptedError,
    WeightUpdateError,
    WeightWriter,
    plan_direct_load,
    plan_weight_load,
    prepare_tensor,
)

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner", "RunnerConfig"]  # RunnerConfig lives in runner.config


class ModelRunner:
    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model_path)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available; use device='cpu'")
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
        self._groups: dict[str, _UpdateGroup | None] = {}  # weight update groups by name (None: joining)
        self._groups_lock = threading.Lock()
        self.custom_loaders = _import_custom_loaders(config.custom_weight_loader)
        self.is_shut_down = False
        self.initialize()

    @property
    def server_config(self) -> RunnerConfig:
        """Old name of `config`, still read by init_device_graphs (another owner's method)."""
        return self.config

    # ---- initialisation, in the seed's order ------------------------------------------------
    def initialize(self) -> None:
        self.sampler = Sampler()
        self.load_model()
        self.configure_kv_cache_dtype()
        self.init_memory_pool()
        self.init_attention_backend()
        self.init_device_graphs()

    def load_model(self) -> None:
        cfg = self.config
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
                with CheckpointIndex(cfg.model_path) as index:
                    self._load_checkpoint(index, WeightWriter(snapshot=False), check=False)
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
        gen = torch.Generator().manual_seed(self.config.random_seed)
        with torch.no_grad():
            for name, p in self.name_map.params.items():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    def _load_checkpoint(self, index: CheckpointIndex, writer: WeightWriter, check: bool) -> None:
        """Headers first, then (check=True) pass 1 reads and checks every tensor, then pass 2 writes.

        Both passes read from the snapshot `index` opened, so they see the same bytes; the model is
        touched only after the whole checkpoint proved good, without holding a second copy. Pass 2
        checks again as it writes (cheap, and a failure there is undone by `writer` anyway).
        """
        self._check_checkpoint_header(index)
        if check:
            plan = WeightPlan(self.name_map, keep=False)
            for name, tensor in index.iter_tensors():
                plan.add(name, tensor, str(index.entries[name].file))
            plan.finish()
        with writer:
            for name, tensor in index.iter_tensors():
                if self.name_map.is_ignored(name) or name in self.name_map.aliases:
                    continue  # aliases were compared in pass 1 (updates); they share a written tensor
                target = self.name_map.resolve(name)
                tensor = prepare_tensor(target, tensor, str(index.entries[name].file), check_finite=check)
                writer.write(target, tensor)

    def _check_checkpoint_header(self, index: CheckpointIndex) -> None:
        """Names, shapes and dtypes from the safetensors headers, before any data is read."""
        for name, entry in index.entries.items():
            if self.name_map.is_ignored(name):
                continue
            try:
                target = self.name_map.resolve(name)
            except WeightUpdateError as e:
                raise WeightUpdateError(f"{entry.file}: {e}") from None
            if target.hf_shape() != entry.shape:
                raise WeightUpdateError(f"{entry.file}: tensor {name!r} has shape {entry.shape}, the model "
                                        f"expects {target.hf_shape()}")
            if not entry.dtype.is_floating_point:
                raise WeightUpdateError(f"{entry.file}: tensor {name!r} has non-float dtype {entry.dtype}")
        missing = [n for n in self.name_map.hf_names() if n not in index.entries]
        if missing:
            raise WeightUpdateError(f"{index.root}: checkpoint is missing {len(missing)} tensors, e.g. {missing[0]!r}")

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
        """Build the captured-decode runner (runner/graph_runner.py) unless disable_cuda_graph:
        CUDA graphs on CUDA, the compiled static-shape decode step on the CPU."""
        self.graph_runner = None
        if self.config.disable_cuda_graph:
            return
        if self.device.type == "cuda":
            from runner.cuda_graph_runner import CudaGraphRunner  # the GPU path only; never imported on CPU

            self.graph_runner = CudaGraphRunner(self)
        elif self.device.type == "cpu" and self.config.cuda_graph_bs:
            # Opt-in on the CPU: compiling costs seconds to minutes per size, measured gains were small
            # (0.92x eager on a 40M model, slower on tiny ones), and a step compiled mid-run rounds
            # differently from the eager one by an ulp, so results must not switch paths silently.
            from runner.cpu_graph_runner import CpuGraphRunner

            self.graph_runner = CpuGraphRunner(self)

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
        if fb.forward_mode.is_decode() and self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)
        # The eager step runs in inference mode: no version counters or view tracking, ~6% of a tiny
        # model's step. Not the captured one above: compiled graphs guard on the autograd mode.
        with (torch.inference_mode(),
              forward_context(ForwardContext(self.attn_backend, self.token_to_kv_pool, self.req_to_token_pool)),
              batch_invariant.mode(self.config.enable_deterministic_inference)):
            self.attn_backend.init_forward_metadata(fb)
            return self.model(fb.input_ids, fb.positions, fb)

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

    # ---- weights: every route ends in _write ------------------------------------------------
    def _require_weights_resident(self) -> None:
        if self.is_shut_down:
            raise WeightUpdateError("the engine was shut down: its weights are freed")
        if not self.memory_saver.is_resident("weights"):
            raise WeightUpdateError("weights are released; call resume_memory_occupation(['weights']) first")

    def new_weight_writer(self) -> WeightWriter:
        """The writer of one update (a tensor-parallel rank's votes before it commits)."""
        return WeightWriter(snapshot=True)

    def _write(self, fill: Callable[[WeightWriter], None], repack_all: bool = False) -> int:
        """Run `fill(writer)` all or nothing; keep the prepacked shadows and validity in step.
        `writer.written` may hold HF or runner parameter names (direct); both count here."""
        writer = self.new_weight_writer()
        try:
            fill(writer)  # enters `writer`: any failure inside restores what it wrote
        except WeightsCorruptedError as e:
            names = self.name_map.covering_hf_names(e.names)
            self.weights_valid = False
            self.invalid_weights |= names
            self.invalid_reason = f"a failed update could not be undone ({len(names)} tensors may be mixed)"
            raise
        finally:  # shadows follow whatever the weights now hold, restored or new
            self._repack(None if repack_all else self.name_map.covering_hf_names(writer.written))
        self._mark_loaded(self.name_map.covering_hf_names(writer.written))
        return len(writer.written)

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None) -> int:
        """(HF name, tensor) pairs or a dict; load_format="flattened_bucket": a bucket dict
        {"flattened_tensor", "metadata"} (or a list of them); "direct": (runner parameter name, whole
        tensor) pairs; one of `custom_weight_loader`: handed to that function. All but the last are
        checked before the first is written. Returns how many tensors were written."""
        self._require_weights_resident()
        if load_format in self.custom_loaders:
            return self._custom_load(load_format, named_tensors)
        if load_format == "direct":
            plan = plan_direct_load(self.name_map, _pairs(named_tensors))
        else:
            plan = plan_weight_load(self.name_map, unpack_named_tensors(named_tensors, load_format,
                                                                        list(self.custom_loaders)))

        def fill(writer: WeightWriter) -> None:
            with writer:
                for target, tensor in plan:
                    writer.write(target, tensor)

        return self._write(fill)

    def _custom_load(self, path: str, named_tensors) -> int:
        """SGLang's custom loader: fn(model, named_tensors) with the tensors on this device. Every
        parameter is snapshotted (on the host) first, since the function may write any of them; if it
        raises or leaves a non-finite value, all are put back."""
        fn = self.custom_loaders[path]
        named = _pairs(named_tensors)
        for name, tensor in named:
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise WeightUpdateError(f"custom weight loader {path!r} takes (name: str, tensor) pairs, got "
                                        f"({name!r}, {type(tensor).__name__})")
        named = [(n, t.to(self.device)) for n, t in named]
        targets = [self.name_map.param_target(n) for n in self.name_map.params]

        def fill(writer: WeightWriter) -> None:
            with writer:
                for target in targets:
                    writer.protect(target)
                try:
                    fn(self.model, named)
                except Exception as e:
                    raise WeightUpdateError(f"custom weight loader {path!r} failed: {type(e).__name__}: {e}") from e
                for target in targets:
                    prepare_tensor(target, target.view(), f"custom weight loader {path!r}")  # finite?
                writer.written |= {n for n, _ in named if n in self.name_map.params or n in self.name_map.targets}

        return self._write(fill, repack_all=True)

    def open_checkpoint(self, model_path: str | Path) -> CheckpointIndex:
        """Open (headers, config check, mappings) a checkpoint for update_weights_from_disk. It touches no
        runner state, so a caller runs it without its locks: a slow disk stalls only that call."""
        try:
            index = CheckpointIndex(model_path)
        except CheckpointError as e:
            raise WeightUpdateError(str(e)) from None
        try:
            self._check_checkpoint_config(index)
        except BaseException:
            index.close()
            raise
        return index

    def update_weights_from_disk(self, model_path: str | Path | CheckpointIndex) -> int:
        """Load a whole HF checkpoint directory (or one open_checkpoint opened), read as one snapshot
        (see runner/checkpoint.py)."""
        self._require_weights_resident()
        try:
            index = model_path if isinstance(model_path, CheckpointIndex) else self.open_checkpoint(model_path)
            with index:
                return self._write(lambda writer: self._load_checkpoint(index, writer, check=True))
        except CheckpointError as e:
            raise WeightUpdateError(str(e)) from None

    def _check_checkpoint_config(self, index: CheckpointIndex) -> None:
        where = index.root / "config.json"
        if index.config_text is None:
            raise WeightUpdateError(f"{where}: no config.json in the checkpoint directory")
        try:
            other = ModelConfig.from_dict(json.loads(index.config_text))
        except (ValueError, KeyError, TypeError) as e:  # KeyError: a required key is missing
            raise WeightUpdateError(f"{where}: {type(e).__name__}: {e}") from None
        mine, theirs = self.model_config.shape_signature(), other.shape_signature()
        diff = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
        if diff:
            raise WeightUpdateError(f"{where}: does not match the running model: "
                                    + ", ".join(f"{k} {a!r} != {b!r}" for k, (a, b) in diff.items()))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str | None = None, timeout_s: float = 120.0) -> None:
        """Join a trainer's broadcast group as rank `rank_offset` (the trainer is rank 0).
        backend None: nccl on CUDA, gloo otherwise."""
        from weight_sync.distributed import create_weight_update_group

        if backend is None:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        with self._groups_lock:
            if group_name in self._groups:
                raise WeightUpdateError(f"weight update group {group_name!r} already exists; destroy it first")
            self._groups[group_name] = None  # reserved: a concurrent join under the same name is refused
        try:
            group = create_weight_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                               backend, timeout_s)
        except BaseException:
            with self._groups_lock:
                del self._groups[group_name]
            raise
        with self._groups_lock:
            self._groups[group_name] = _UpdateGroup(group)

    def _group(self, group_name: str) -> _UpdateGroup:
        with self._groups_lock:
            entry = self._groups.get(group_name)
        if entry is None:
            raise WeightUpdateError(f"no weight update group {group_name!r}; call init_weights_update_group first"
                                    f" (groups: {sorted(self._groups)})")
        return entry

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
        from weight_sync.distributed import receive_named_tensors

        entry = self._group(group_name)
        with entry.lock:
            if entry.destroyed:
                raise WeightUpdateError(f"weight update group {group_name!r} was destroyed")
            named = receive_named_tensors(entry.group, names, dtypes, shapes, self.device, load_format=load_format)
            return (load or self.update_weights_from_tensor)(named)

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave `group_name` and free the name; waits for a receive in progress on it to end."""
        from weight_sync import distributed

        with self._groups_lock:
            entry = self._groups.get(group_name)
            if entry is None:
                raise WeightUpdateError(f"no weight update group {group_name!r} (groups: {sorted(self._groups)})")
            del self._groups[group_name]
        with entry.lock:
            entry.destroyed = True
            destroy = getattr(distributed, "destroy_weight_update_group", None)
            if destroy is not None:
                destroy(entry.group)
            else:  # older weight_sync: dropping the last reference closes the group
                entry.group = None

    def _mark_loaded(self, hf_names: set[str]) -> None:
        if self.invalid_weights:
            self.invalid_weights -= hf_names
            self.weights_valid = not self.invalid_weights
            if self.weights_valid:
                self.invalid_reason = ""

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows (elements for 1-D) of an HF-named weight; a tied
        lm_head.weight reads as the embedding it shares."""
        self._require_weights_resident()
        target = self.name_map.resolve(name)
        if target.hf_name in self.invalid_weights:
            raise WeightUpdateError(f"weight {name!r} is invalid ({self.invalid_weights_message()})")
        view = target.view()
        return view.reshape(-1)[:truncate_size].float().cpu().tolist() if view.dim() == 1 else \
            view[: max(1, truncate_size)].float().cpu().tolist()

    # ---- memory release / resume ----------------------------------------------------------
    def check_memory_transition(self, tags: list[str] | None, release: bool) -> list[str]:
        """The tags a release (or resume) of `tags` acts on; RuntimeError, naming them, if any is already
        released (or still resident): SGLang refuses both rather than doing nothing. None or [] means
        every tag, as in SGLang."""
        tags = check_memory_tags(tags or None)
        if not self.config.enable_memory_saver:
            self.memory_saver.pause(tags[0])  # raises the saver's own "disabled" message
        if release:
            bad = [t for t in tags if not self.memory_saver.is_resident(t)]
            if bad:
                raise RuntimeError(f"release_memory_occupation({tags}): {bad} already released; call "
                                   f"resume_memory_occupation({bad}) first")
        else:
            bad = [t for t in tags if self.memory_saver.is_resident(t)]
            if bad:
                raise RuntimeError(f"resume_memory_occupation({tags}): {bad} not released (resident); resume "
                                   f"only what release_memory_occupation released")
        return tags

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Release `tags` (None: all). Each must be resident (checked before anything is released)."""
        tags = self.check_memory_transition(tags, release=True)
        for tag in tags:
            self.memory_saver.pause(tag)  # first: a refusal (saver disabled) must leave everything as it was
            if tag == "weights":
                self._drop_packs()  # shadows of the weights go with them
            if tag == "kv_cache":
                self.token_to_kv_pool.clear()
            if tag == "weights" and not self.memory_saver.has_cpu_backup("weights"):
                self.weights_valid = False
                self.invalid_weights = set(self.name_map.hf_names())
                self.invalid_reason = ""  # the release explains it now

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Resume `tags` (None: all). Each must be released (checked before anything is resumed)."""
        tags = self.check_memory_transition(tags, release=False)
        for tag in tags:
            self.memory_saver.resume(tag)
            if tag == "kv_cache":
                # Resumed memory holds whatever was there before (NaN included). Attention reads the
                # padding slot 0 for masked positions, and 0 * NaN would poison the real ones.
                pool = self.token_to_kv_pool
                pool.k_buffer[:, 0].zero_()
                pool.v_buffer[:, 0].zero_()
                # The request->slot table lives in the same region (torch_memory_saver hands it back
                # undefined); graph padding rows read row 0, so an out-of-range slot must never be there.
                # No request holds a row across a release (it is refused unless they are retracted).
                self.req_to_token_pool.req_to_token.zero_()
            if tag == "weights" and self.memory_saver.has_cpu_backup("weights"):
                self._repack(None)  # without backup, shadows come back module by module with updates

    def shutdown(self) -> None:
        """Leave every weight-update group and free every tensor this runner holds. Storages are
        freed in place (not just dereferenced), so the memory goes back even while a caller still
        holds the model, the runner or the Engine. The runner is unusable afterwards. Idempotent."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        with self._groups_lock:
            names = [n for n, e in self._groups.items() if e is not None]
        for name in names:
            try:
                self.destroy_weights_update_group(name)
            except Exception:  # a group already broken must not stop the shutdown
                logger.warning("destroying weight update group %r at shutdown failed", name, exc_info=True)
        self.memory_saver.close()  # maps released regions back first (freeing paused memory is unsafe)
        self.weights_valid = False
        self.invalid_reason = "the engine was shut down"
        self._drop_packs()
        tensors = [*self.model.parameters(), *self.model.buffers()]
        for holder in (self.token_to_kv_pool, self.req_to_token_pool, self.graph_runner, self.attn_backend):
            tensors += [v for v in vars(holder).values() if isinstance(v, torch.Tensor)] if holder else []
        for t in tensors:
            t.untyped_storage().resize_(0)
        self.memory_saver.free()
        # Graphs (and their private pools), compiled steps and backends hold more: drop them too.
        self.graph_runner = self.attn_backend = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        else:
            release_host_memory()


class _UpdateGroup:
    """A joined broadcast group and the lock that serialises receives on it."""

    def __init__(self, group) -> None:
        self.group = group
        self.lock = threading.Lock()
        self.destroyed = False


def _pairs(named_tensors) -> list[tuple[str, torch.Tensor]]:
    if isinstance(named_tensors, dict):
        named_tensors = list(named_tensors.items())
    items = list(named_tensors)
    if not all(isinstance(x, tuple | list) and len(x) == 2 for x in items):
        raise WeightUpdateError("named_tensors must be a list of (name, tensor) pairs or a dict")
    return [(n, t) for n, t in items]


def _import_custom_loaders(paths: list[str] | None) -> dict[str, Callable]:
    """custom_weight_loader's dotted paths -> the functions, imported now so a bad path fails at init."""
    loaders = {}
    for path in paths or []:
        module, _, attr = path.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"custom_weight_loader {path!r} cannot be imported: {type(e).__name__}: {e}") from None
        if not callable(fn):
            raise ValueError(f"custom_weight_loader {path!r} is not callable")
        loaders[path] = fn
    return loaders


def unpack_named_tensors(named_tensors, load_format: str | None,
                         custom: list[str] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of an update: plain pairs, a dict, or flattened buckets (weight_sync's
    wire format, unpacked into views without copies)."""
    if load_format in (None, "auto"):
        return _pairs(named_tensors)
    if load_format == "flattened_bucket":
        from weight_sync.bucket import FlattenedTensorBucket

        buckets = named_tensors if isinstance(named_tensors, list) else [named_tensors]
        out = []
        for b in buckets:
            bucket = b if isinstance(b, FlattenedTensorBucket) else FlattenedTensorBucket.from_dict(b)
            out.extend(bucket.named_tensors())
        return out
    raise WeightUpdateError(f"load_format={load_format!r}: choose None, 'direct', 'flattened_bucket' or one of "
                            f"custom_weight_loader {custom or []} (given when the engine is created)")
