"""LoRAManager: the runner's loaded adapters, their device slots, and each step's LoRA batch.

Built by ModelRunner when enable_lora: it attaches a LoRAModule (runner/lora/layer.py) to every adapted
projection of the model and allocates `max_loaded_loras` slots in each, inside the memory saver's
`weights` region (released and resumed with the weights, host backup included). Adapters are
addressed by name; each load gets a fresh `uid`, which is what requests and the prefix cache key on, so
an adapter replaced under the same name never shares KV with its predecessor.

`stage` checks everything (runner/lora/adapter.py) and writes nothing; `commit` writes a free slot that no
step reads until the adapter is registered, so a refused or failed load changes nothing (tensor-parallel
ranks vote between the two, runner/tp/). `prepare(fb)` turns the
batch's per-request adapter uids into the step's LoRABatch (by default the adapted token rows grouped by
adapter, one stable sort per step; with `segmented` off, a 0/1 mask over every adapter) and gathers the batch's slots (cached while the adapter set stays the same). Deciding which requests may share a batch, and waiting for requests before
an unload, are the scheduler's and the Engine's.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from runner.lora.adapter import read_adapter_dir, stage_adapter
from runner.lora.config import AdapterConfig
from runner.lora.layer import LoRABatch, LoRAModule, LoRATarget

logger = logging.getLogger(__name__)
TENSOR_PATH = "__tensor__"  # SGLang's lora_path of an adapter loaded from tensors

_uids = itertools.count(1)

MAX_LORA_NAME_CHARS = 256  # vLLM and SGLang set none; a name is an id, echoed in every listing



def new_uid() -> int:
    """A load uid never handed out before in this process."""
    return next(_uids)


@dataclass
class LoadedAdapter:
    name: str
    uid: int
    slot: int
    config: AdapterConfig
    path: str
    pinned: bool


@dataclass
class StagedAdapter:
    """A checked adapter, not yet written: its host slot buffers per (layer, module) and what made them."""

    name: str
    config: AdapterConfig
    path: str
    pinned: bool
    tensors: dict  # PEFT name -> tensor, as given (tensor-parallel rank 0 forwards them to the other ranks)
    slots: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _targets_of(layer) -> list[tuple[str, object, list[tuple[str, object]]]]:
    """(module name, module, [(PEFT target, shard id)]) of one decoder layer's adaptable projections."""
    out = []
    attn, mlp = layer.self_attn, getattr(layer, "mlp", None)
    out.append(("qkv_proj", attn.qkv_proj, [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")]))
    out.append(("o_proj", attn.o_proj, [("o_proj", None)]))
    if mlp is not None and hasattr(mlp, "gate_up_proj"):  # MoE blocks have experts instead: not adapted
        out.append(("gate_up_proj", mlp.gate_up_proj, [("gate_proj", 0), ("up_proj", 1)]))
        out.append(("down_proj", mlp.down_proj, [("down_proj", None)]))
    return out


def _target_spec(module, name: str, shard) -> LoRATarget:
    w = module.weight
    in_local = w.shape[1]
    if shard is None:
        out_offset, out_size = 0, w.shape[0]
    else:
        out_offset, out_size = w.shard_offsets[shard]
    tp = getattr(w, "tp_slices", None) or {}
    b_rows = a_cols = None
    out_full, in_full = out_size, in_local
    if shard is not None and shard in tp:  # column parallel: (0, start, size, full) rows of this shard
        _, start, size, out_full = tp[shard]
        b_rows = (start, size)
    if shard is None and None in tp:  # row parallel: (1, start, size, full) input columns
        _, start, size, in_full = tp[None]
        a_cols = (start, size)
    return LoRATarget(name, in_full, out_full, out_offset, out_size, b_rows, a_cols)


class LoRAManager:
    def __init__(self, runner) -> None:
        cfg = runner.config
        self.runner = runner
        self.max_rank = cfg.max_lora_rank
        self.max_per_batch = cfg.max_loras_per_batch
        self.num_slots = cfg.max_loaded_loras
        self.enabled = tuple(cfg.lora_target_modules)
        self.dtype, self.device = runner.dtype, runner.device
        layers = runner.model.model.layers
        self.num_layers = len(layers)
        self.modules: dict[tuple[int, str], LoRAModule] = {}
        for i, layer in enumerate(layers):
            for mod_name, module, shards in _targets_of(layer):
                targets = [_target_spec(module, t, s) for t, s in shards if t in self.enabled]
                if not targets:
                    continue
                w = module.weight
                lm = LoRAModule(i, mod_name, targets, w.shape[1], w.shape[0], self.num_slots, self.max_rank,
                                self.dtype, self.device)
                module.lora = lm
                self.modules[(i, mod_name)] = lm
        if not self.modules:
            raise ValueError(f"lora_target_modules={list(self.enabled)} match no projection of this model")
        saver = runner.memory_saver
        with saver.region("weights", enable_cpu_backup=cfg.enable_weights_cpu_backup):
            saver.track("weights", [t for m in self.modules.values() for t in m.tensors()])
        self.adapters: dict[str, LoadedAdapter] = {}
        # uid -> (name, why) of adapters dropped by a release, so a request still on one is told which and why
        self.dropped: dict[int, tuple[str, str]] = {}
        self.by_uid: dict[int, LoadedAdapter] = {}
        self.free_slots = list(range(self.num_slots))
        self._batch_key: tuple | None = None  # (slots,) of the gathered batch buffers
        self.pool_epoch = 0
        self.pad_limit = 2.0  # padded rows allowed, as a multiple of the adapted ones, before the per-segment path
        # The segmented formulation is the default: on the CPU at decode batch 16 over 4 adapters it measured
        # 1.04-1.14x the masked one (bench/lora.py, three runs at load 0.8-1.3), whose cost also grows with
        # the number of adapters in the batch. False selects the masked one (every row x every adapter).
        self.segmented = True

    # ---- adapters ----------------------------------------------------------------------------
    def loaded_adapters(self) -> dict[str, str]:
        """SGLang's `loaded_adapters`: name -> path ("__tensor__" for tensor loads)."""
        return {a.name: a.path for a in self.adapters.values()}

    def resolve(self, name: str) -> int:
        """The uid requests use for adapter `name`; ValueError naming it if it is not loaded."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded; loaded: {sorted(self.adapters)}")
        return adapter.uid

    def stage(self, name: str, path: str | None = None, tensors: dict | None = None,
              config_dict: dict | None = None, pinned: bool = False) -> StagedAdapter:
        """Check a load from a PEFT directory (`path`) or from (`tensors`, `config_dict`) and build its host
        buffers; ValueError/RuntimeError naming the problem. Writes nothing: `commit` does."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_name must be a non-empty string, got {name!r}")
        # A name is echoed in every "loaded: [...]" message, log line and metric label, and is an OpenAI `model`.
        if len(name) > MAX_LORA_NAME_CHARS or not name.isprintable():
            raise ValueError(f"lora_name must be at most {MAX_LORA_NAME_CHARS} printable characters (no control "
                             f"characters such as NUL or newline), got {name[:80]!r}"
                             + (f"... ({len(name)} characters)" if len(name) > 80 else ""))
        if name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded; unload it first (or use a new name)")
        if not self.free_slots:  # SGLang's refusal, in its words (its tests read them)
            raise ValueError(f"Cannot load LoRA adapter {name!r}" + (f" at path {path}" if path else "")
                             + f". Maximum number of loaded LoRA adapters is {self.num_slots} (max_loaded_loras; "
                             f"loaded: {sorted(self.adapters)}). Please unload some LoRA adapters before loading "
                             f"new ones.")
        if not self.runner.memory_saver.is_resident("weights"):
            raise RuntimeError("weights are released: call resume_memory_occupation(['weights']) before loading "
                               "a LoRA adapter")
        if path is not None:
            config, tensors = read_adapter_dir(path)
        else:
            config = AdapterConfig.from_dict(config_dict)
            if isinstance(tensors, (list, tuple)):
                tensors = dict(tensors)
            if not isinstance(tensors, dict):
                raise ValueError(f"tensors must be a dict (or pairs) of PEFT name -> tensor, got {type(tensors).__name__}")
        staged = stage_adapter(config, tensors, self.modules, self.num_layers, self.max_rank, self.enabled, self.dtype)
        return StagedAdapter(name, config, path if path is not None else TENSOR_PATH, pinned, tensors, staged)

    def check_commit(self, staged: StagedAdapter) -> None:
        """`commit` will succeed (re-checked only for a state changed since `stage`)."""
        if staged.name in self.adapters or not self.free_slots:
            raise RuntimeError(f"LoRA adapter {staged.name!r}: the loaded adapters changed between check and commit")

    def commit(self, staged: StagedAdapter, uid: int | None = None) -> LoadedAdapter:
        """Write a staged adapter into a free slot and register it (under `uid`, or a fresh one: tensor-parallel
        ranks take rank 0's, so a batch's uids mean the same adapter on every rank)."""
        self.check_commit(staged)
        slot = self.free_slots[0]
        with torch.no_grad():  # a free slot: no step reads it until the adapter is registered below
            for key, module in self.modules.items():
                if key in staged.slots:
                    module.write_slot(slot, *staged.slots[key])
                else:
                    module.a_pool[slot].zero_()
                    module.b_pool[slot].zero_()
        self.free_slots.pop(0)
        adapter = LoadedAdapter(staged.name, new_uid() if uid is None else uid, slot, staged.config, staged.path,
                                staged.pinned)
        self.adapters[staged.name] = adapter
        self.by_uid[adapter.uid] = adapter
        self.pool_epoch += 1
        return adapter

    def load(self, name: str, path: str | None = None, tensors: dict | None = None, config_dict: dict | None = None,
             pinned: bool = False) -> LoadedAdapter:
        """`stage` then `commit`: nothing changed on any problem."""
        return self.commit(self.stage(name, path, tensors, config_dict, pinned))

    def check_unload(self, name: str) -> LoadedAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded; loaded: {sorted(self.adapters)}")
        return adapter

    def unload(self, name: str) -> LoadedAdapter:
        """Forget `name` (the caller made sure no request uses it); its slot becomes free."""
        adapter = self.check_unload(name)
        del self.adapters[name]
        del self.by_uid[adapter.uid]
        self.free_slots.append(adapter.slot)
        self.pool_epoch += 1
        return adapter

    def on_weights_released(self, has_backup: bool) -> None:
        """Weights (and the adapter slots with them) were released: without a backup the slots come back
        undefined, so every adapter is dropped (load them again after the resume)."""
        self._drop_batch()
        if not has_backup and self.adapters:
            logger.warning("LoRA adapters %s dropped: weights released without CPU backup", sorted(self.adapters))
            for name in list(self.adapters):
                adapter = self.unload(name)
                self.dropped[adapter.uid] = (name, "dropped when the weights were released without "
                                                   "enable_weights_cpu_backup (load it again after the resume)")

    def on_weights_resumed(self) -> None:
        self._drop_batch()

    def _drop_batch(self) -> None:
        self._batch_key = None
        for m in self.modules.values():
            m.drop_batch()

    # ---- one step ------------------------------------------------------------------------------
    def prepare(self, fb) -> LoRABatch | None:
        """The step's LoRABatch (its adapted token rows grouped by adapter, stable), with every module's
        batch buffers gathered; None when no request of the batch uses an adapter."""
        uids = fb.lora_ids
        if not uids or all(u is None for u in uids):
            return None
        adapters = []
        for u in uids:
            if u is not None:
                if u not in self.by_uid:
                    name, why = self.dropped.get(u, (f"uid {u}", "unloaded under a running request"))
                    raise RuntimeError(f"LoRA adapter {name!r} this request was admitted with is gone: {why}; a "
                                       f"reloaded adapter of that name is a new one, so resubmit the request")
                adapters.append(self.by_uid[u])
        slots = sorted({a.slot for a in adapters})
        if len(slots) > self.max_per_batch:
            raise RuntimeError(f"batch uses {len(slots)} LoRA adapters; max_loras_per_batch={self.max_per_batch}")
        key = (tuple(slots), self.pool_epoch)
        if key != self._batch_key:
            index = torch.tensor(slots, dtype=torch.int64, device=self.device)
            by_slot = {a.slot: a.config.scaling for a in adapters}
            scalings = torch.tensor([by_slot[s] for s in slots], dtype=self.dtype, device=self.device)
            for m in self.modules.values():
                m.gather(index, scalings)
            self._batch_key = key
        col = {s: j for j, s in enumerate(slots)}
        g = len(slots)
        req_col = [g if u is None else col[self.by_uid[u].slot] for u in uids]  # g: the base model
        lens = fb.extend_seq_lens_cpu if fb.forward_mode.is_extend() else [1] * len(uids)
        counts = [0] * (g + 1)
        for c, n in zip(req_col, lens):
            counts[c] += n
        n_tok = sum(lens)
        if not self.segmented:
            mask = torch.zeros(len(uids), g, dtype=torch.bool)
            for i, c in enumerate(req_col):
                if c < g:
                    mask[i, c] = True
            mask = mask.repeat_interleave(torch.tensor(lens), dim=0).to(self.device)  # [num_tokens, g]
            return LoRABatch(masked=mask)
        tok_col = torch.tensor(req_col).repeat_interleave(torch.tensor(lens))  # [num_tokens], g: the base model
        order = torch.argsort(tok_col, stable=True)  # token rows grouped by adapter, base rows last
        m = n_tok - counts[g]
        seg_len = max(counts[:g]) + (1 if counts[g] else 0)  # a base row needs a padding row to point at
        if g * seg_len > self.pad_limit * max(m, 1) and g > 1:  # padding would dominate: a matmul per segment
            ends = list(itertools.accumulate(counts[:g]))
            return LoRABatch(rows=order[:m].to(self.device), segments=tuple(zip([0, *ends[:-1]], ends)))
        if g * seg_len == n_tok and counts[g] == 0 and bool((order == torch.arange(n_tok)).all()):
            return LoRABatch(seg_len=seg_len)  # equal segments, already grouped, no base rows: no index at all
        gather = torch.zeros(g, seg_len, dtype=torch.int64)
        valid = torch.zeros(g, seg_len, 1, dtype=torch.bool)
        scatter = torch.empty(n_tok, dtype=torch.int64)
        start = 0
        for j in range(g):
            rows_j = order[start:start + counts[j]]
            gather[j, :counts[j]] = rows_j
            valid[j, :counts[j]] = True
            scatter[rows_j] = j * seg_len + torch.arange(counts[j])
            start += counts[j]
        if counts[g]:
            pad_of = [j for j in range(g) if counts[j] < seg_len][0]  # a zero row of the padded output
            scatter[order[m:]] = pad_of * seg_len + seg_len - 1
        padded = not bool(valid.all())
        return LoRABatch(seg_len=seg_len, gather=gather.view(-1).to(self.device),
                         valid=valid.to(self.device) if padded else None, scatter=scatter.to(self.device))
