"""EngineArgs: every Engine option with its SGLang name, validated before anything is built."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from rollout.scheduler import SchedulerConfig
from runner.model_runner import RunnerConfig


@dataclass
class EngineArgs:
    model_path: str
    device: str = "cpu"
    dtype: str = "auto"
    load_format: str = "auto"
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None
    max_running_requests: int = 512
    context_length: int | None = None
    kv_cache_dtype: str = "auto"
    cpu_kv_cache_bytes: int = 1 << 30
    chunked_prefill_size: int = 2048
    disable_radix_cache: bool = False
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    attention_backend: str | None = None
    disable_cuda_graph: bool = False
    tp_size: int = 1
    random_seed: int = 0
    cpu_prepack: bool = True
    skip_tokenizer_init: bool = False
    show_progress: bool = True
    log_level: str = "warning"

    @classmethod
    def from_kwargs(cls, model_path: str | None, **kwargs) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Engine got unknown argument(s) {unknown}; known: {sorted(known - {'model_path'})}")
        if model_path is None:
            model_path = kwargs.pop("model_path", None)
        if not model_path:
            raise ValueError("Engine needs model_path (an HF checkpoint directory)")
        return cls(model_path=str(model_path), **kwargs)

    def runner_config(self) -> RunnerConfig:
        names = {f.name for f in fields(RunnerConfig)}
        return RunnerConfig(**{k: v for k, v in asdict(self).items() if k in names})

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(chunked_prefill_size=self.chunked_prefill_size,
                               max_running_requests=self.max_running_requests,
                               disable_radix_cache=self.disable_radix_cache)
