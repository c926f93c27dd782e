"""LoRA options and adapter configs: SGLang's engine options and PEFT's adapter_config.json, validated.

`parse_lora_paths` takes SGLang's three spellings of `lora_paths` (a dict name -> path, a list of
"name=path" / "path" strings, a list of {"lora_name", "lora_path", "pinned"} dicts) and returns one
list of `LoRASource`. `AdapterConfig.from_dict` reads a PEFT LoRA config (what `save_pretrained`
writes) and refuses, by name, every field whose meaning this engine does not implement (DoRA, LoRA
biases, fan_in_fan_out, modules_to_save, per-module rank/alpha patterns). It reads no tensors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# PEFT target names -> the runner module they adapt (and the shard of it for fused ones).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class LoRASource:
    lora_name: str
    lora_path: str
    pinned: bool = False


def parse_lora_paths(lora_paths) -> list[LoRASource]:
    """SGLang's `lora_paths` in any of its forms -> [LoRASource]; a bare path is named by itself."""
    if lora_paths is None:
        return []
    if isinstance(lora_paths, dict):
        items = [{"lora_name": k, "lora_path": v} for k, v in lora_paths.items()]
    elif isinstance(lora_paths, (list, tuple)):
        items = list(lora_paths)
    else:
        raise ValueError(f"lora_paths must be a dict name -> path, or a list of 'name=path' strings or "
                         f"{{'lora_name', 'lora_path', 'pinned'}} dicts; got {type(lora_paths).__name__}")
    out: list[LoRASource] = []
    for item in items:
        if isinstance(item, str):
            if item.lstrip().startswith("{"):
                item = json.loads(item)  # SGLang's CLI takes the dict form as a JSON string
            else:
                name, sep, path = item.partition("=")
                item = {"lora_name": name, "lora_path": path} if sep else {"lora_name": item, "lora_path": item}
        if not isinstance(item, dict) or set(item) - {"lora_name", "lora_path", "pinned"} \
                or not {"lora_name", "lora_path"} <= set(item):
            raise ValueError(f"lora_paths entry {item!r}: expected 'name=path' or a dict with keys "
                             f"lora_name, lora_path and optionally pinned")
        src = LoRASource(str(item["lora_name"]), str(item["lora_path"]), bool(item.get("pinned", False)))
        if not src.lora_name or not src.lora_path:
            raise ValueError(f"lora_paths entry {item!r}: empty lora_name or lora_path")
        out.append(src)
    names = [s.lora_name for s in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"lora_paths names {dup} more than once")
    return out


def normalize_target_modules(targets) -> tuple[str, ...]:
    """SGLang's `lora_target_modules`: names from TARGET_MODULES, or ["all"] / "all-linear" for every one."""
    if isinstance(targets, str):
        targets = [targets]
    targets = list(targets)
    if any(t in ("all", "all-linear") for t in targets):
        return TARGET_MODULES
    bad = sorted(set(targets) - set(TARGET_MODULES))
    if bad:
        raise ValueError(f"lora_target_modules {bad} are not supported; choose from {list(TARGET_MODULES)} or 'all'")
    return tuple(t for t in TARGET_MODULES if t in targets)


@dataclass(frozen=True)
class AdapterConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | None  # None: PEFT saved a regex; the tensors say which

    @property
    def scaling(self) -> float:
        """PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_dict(cls, d: dict) -> AdapterConfig:
        if not isinstance(d, dict):
            raise ValueError(f"adapter config must be a dict (adapter_config.json), got {type(d).__name__}")
        peft_type = d.get("peft_type", "LORA")
        peft_type = getattr(peft_type, "value", peft_type)  # peft's PeftType enum, as LoraConfig.to_dict() gives it
        if str(peft_type).upper() != "LORA":
            raise ValueError(f"adapter config peft_type={peft_type!r}: only LORA adapters are supported")
        r = d.get("r")
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"adapter config r={r!r} must be an int >= 1")
        alpha = d.get("lora_alpha", 8)
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
            raise ValueError(f"adapter config lora_alpha={alpha!r} must be a finite number")
        if d.get("target_parameters") not in (None, []):
            # Checked first: peft fills rank_pattern for the parameters it adapts, and that message would hide this.
            raise ValueError(f"adapter config target_parameters={d['target_parameters']!r}: LoRA on parameters "
                             f"(peft's form for fused MoE experts) is not supported; MoE models take adapters on "
                             f"their attention projections (q_proj, k_proj, v_proj, o_proj)")
        refused = {
            "use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
            "modules_to_save": (None, []), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
            "use_qalora": (False, None), "target_parameters": (None, []),
            # Keys that change the forward without adding tensors of their own, so no tensor check would see
            # them: aLoRA (the adapter acts only after its invocation tokens), duplicated layers, Arrow routing.
            "alora_invocation_tokens": (None, []), "layer_replication": (None, []), "arrow_config": (None, {}),
        }
        for key, ok in refused.items():
            if key in d and d[key] not in ok:
                raise ValueError(f"adapter config {key}={d[key]!r} is not supported (supported: {ok[0]!r})")
        init = d.get("init_lora_weights", True)
        if init not in (True, False, "gaussian"):
            # PiSSA, OLoRA, LoftQ, LoRA-GA, CorDA... rewrite the base weights when PEFT loads the adapter (it
            # re-runs the init), so their B @ A is a delta over weights this engine does not hold.
            raise ValueError(f"adapter config init_lora_weights={init!r} is not supported: PEFT rewrites the base "
                             f"weights when it loads such an adapter; save it with save_pretrained("
                             f"path_initial_model_for_weight_conversion=...) to get a LoRA over the original base "
                             f"(supported: True, False, 'gaussian')")
        if d.get("layers_to_transform") is not None or d.get("layers_pattern") not in (None, [], ""):
            raise ValueError("adapter config layers_to_transform / layers_pattern are not supported: "
                             "save an adapter over every layer")
        targets = d.get("target_modules")
        if isinstance(targets, (list, tuple, set)):
            names = {str(t).rsplit(".", 1)[-1] for t in targets}
            bad = sorted(names - set(TARGET_MODULES))
            if bad:
                raise ValueError(f"adapter targets {bad}: only {list(TARGET_MODULES)} are supported")
            targets = tuple(t for t in TARGET_MODULES if t in names)
        else:
            targets = None
        use_rslora = d.get("use_rslora", False)
        if not isinstance(use_rslora, bool):
            raise ValueError(f"adapter config use_rslora={use_rslora!r} must be a bool")
        return cls(r, float(alpha), use_rslora, targets)

    @classmethod
    def from_dir(cls, path: str | Path) -> AdapterConfig:
        file = Path(path) / "adapter_config.json"
        if not file.is_file():
            raise ValueError(f"LoRA adapter {str(path)!r} has no adapter_config.json (a PEFT save_pretrained "
                             f"directory is expected)")
        try:
            raw = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} is not a valid JSON file: {e}") from None
        return cls.from_dict(raw)


def infer_options(sources: list[LoRASource], max_lora_rank: int | None,
                  target_modules) -> tuple[int, tuple[str, ...]]:
    """max_lora_rank and lora_target_modules as SGLang infers them: from the initial adapters when not
    given; both required when there are none (later loads must fit buffers sized now)."""
    configs = [AdapterConfig.from_dir(s.lora_path) for s in sources]
    if max_lora_rank is None:
        if not configs:
            raise ValueError("enable_lora without lora_paths needs max_lora_rank (the largest rank to be loaded)")
        max_lora_rank = max(c.r for c in configs)
    if target_modules is None:
        if not configs:
            raise ValueError("enable_lora without lora_paths needs lora_target_modules (e.g. ['q_proj', 'v_proj'] "
                             "or ['all'])")
        if any(c.target_modules is None for c in configs):
            target_modules = TARGET_MODULES
        else:
            target_modules = tuple(t for t in TARGET_MODULES if any(t in c.target_modules for c in configs))
    return max_lora_rank, normalize_target_modules(target_modules)
