"""The trainers' rollout engines: one in-process Engine, one Engine in a child process (--engine-process),
or several as Ray actors behind one group.

Both answer the same calls the loops make (generate, release/resume, update_weights_from_tensor via
sync_weights, get_server_info), so GRPO and PPO do not care which they hold. Does not place trainer
workers: the trainer stays in this process.
"""

from __future__ import annotations

from rollout import Engine


def make_engine(cfg):
    """An Engine, or an EngineGroup of `cfg.num_engines` Ray actors when more than one is asked for."""
    # On the CPU a small KV pool is plenty for these rollouts and keeps release/resume cheap.
    kw = dict(device=cfg.device, enable_memory_saver=True, random_seed=cfg.seed,
              mem_fraction_static=cfg.engine_mem_fraction, show_progress=False)
    if cfg.device == "cpu":
        kw["cpu_kv_cache_bytes"] = 256 << 20
    if getattr(cfg, "deterministic", False):
        kw["enable_deterministic_inference"] = True
    if getattr(cfg, "dtype", "float32") != "float32":
        kw["dtype"] = cfg.dtype
    if cfg.tp_size != 1:
        kw["tp_size"] = cfg.tp_size
    if getattr(cfg, "lora_rank", 0):
        # The base weights never change: keep them on the host across releases, sync only the adapter.
        kw.update(enable_lora=True, max_lora_rank=cfg.lora_rank, lora_target_modules=["all"],
                  enable_weights_cpu_backup=True)
    if getattr(cfg, "delta_sync", False):  # a delta applies to the weights the engine held: keep them
        kw["enable_weights_cpu_backup"] = True  # across release/resume (a host copy), or every sync is full
    if getattr(cfg, "routing_replay", False):  # the trainer replays the experts each rollout token used
        kw["enable_return_routed_experts"] = True
    if getattr(cfg, "engine_process", False):
        return engine_process(cfg.model, **kw)
    if cfg.num_engines == 1:
        return Engine(cfg.model, **kw)
    import ray

    from rollout.ray import launch_engines

    if not ray.is_initialized():
        ray.init(num_cpus=max(2, cfg.num_engines), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    gpus = 1 / cfg.num_engines if cfg.device == "cuda" else 0  # co-located: engines share the trainer's GPU
    return launch_engines(cfg.num_engines, cfg.model, num_cpus_per_engine=0.5, num_gpus_per_engine=gpus, **kw)


def engine_process(model: str, **kw):
    """The Engine in a child process (weight_sync.cross_process.RemoteEngine): CUDA weights reach it as
    CUDA IPC handles, host weights through shared memory. On CUDA with torch_memory_saver installed the
    child starts with its preload hook (LD_PRELOAD), so its graph memory is pauseable too."""
    from runner import omp_env
    from weight_sync.cross_process import RemoteEngine

    env = omp_env.child_defaults()  # libgomp's spin before it sleeps (runner/omp_env.py), read as the child loads
    if kw.get("device") == "cuda":
        try:
            import torch_memory_saver.utils as tms_utils

            env["LD_PRELOAD"] = tms_utils.get_binary_path_from_package("torch_memory_saver_hook_mode_preload")
        except Exception:  # noqa: BLE001 - not installed or no binary: the child uses the portable saver
            pass
    return RemoteEngine("rollout:Engine", child_env=env, model_path=model, **kw)


def engine_bytes(engine) -> int:
    """Device (or host, on the CPU) bytes the engine(s) hold, over every memory tag."""
    info = engine.get_server_info()
    infos = info if isinstance(info, list) else [info]
    return sum(sum(i["memory_bytes"].values()) for i in infos)
