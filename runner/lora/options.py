"""The LoRA fields of RunnerConfig, validated and completed (SGLang's rules), before anything is built."""

from __future__ import annotations

from runner.lora.config import infer_options, parse_lora_paths


def validate_lora_options(cfg) -> None:
    """Normalise cfg's LoRA options in place: lora_paths to a list of dicts, max_lora_rank and
    lora_target_modules inferred from the initial adapters, max_loaded_loras defaulted. Idempotent (the
    tensor-parallel workers re-run it on the JSON of an already validated config)."""
    sources = parse_lora_paths(cfg.lora_paths)
    if cfg.enable_lora is None:
        cfg.enable_lora = bool(sources)
    if not isinstance(cfg.enable_lora, bool):
        raise ValueError(f"enable_lora={cfg.enable_lora!r} must be a bool or None")
    if sources and not cfg.enable_lora:
        raise ValueError("lora_paths given with enable_lora=False; drop one of them")
    if not isinstance(cfg.max_loras_per_batch, int) or cfg.max_loras_per_batch < 1:
        raise ValueError(f"max_loras_per_batch={cfg.max_loras_per_batch!r} must be an int >= 1")
    if not cfg.enable_lora:
        return
    if cfg.enable_deterministic_inference:
        raise ValueError("enable_lora with enable_deterministic_inference is not supported: the LoRA matmuls are "
                         "not batch-invariant here; turn one of them off")
    rank, targets = infer_options(sources, cfg.max_lora_rank, cfg.lora_target_modules)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"max_lora_rank={rank!r} must be an int >= 1")
    too_big = [s.lora_name for s in sources if _rank(s) > rank]
    if too_big:
        raise ValueError(f"lora_paths {too_big} have a rank above max_lora_rank={rank}")
    loaded = cfg.max_loaded_loras
    if loaded is None:
        loaded = max(cfg.max_loras_per_batch, len(sources))
    if not isinstance(loaded, int) or loaded < cfg.max_loras_per_batch:
        raise ValueError(f"max_loaded_loras={loaded!r} must be an int >= max_loras_per_batch="
                         f"{cfg.max_loras_per_batch} (SGLang's rule)")
    if loaded < len(sources):
        raise ValueError(f"max_loaded_loras={loaded} is below the {len(sources)} adapters in lora_paths")
    cfg.max_lora_rank, cfg.lora_target_modules, cfg.max_loaded_loras = rank, list(targets), loaded
    cfg.lora_paths = [{"lora_name": s.lora_name, "lora_path": s.lora_path, "pinned": s.pinned} for s in sources]


def _rank(source) -> int:
    from runner.lora.config import AdapterConfig

    return AdapterConfig.from_dir(source.lora_path).r
