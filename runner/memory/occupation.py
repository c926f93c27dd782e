"""Release and resume of a runner's memory, per tag, and the final free at shutdown.

Release and resume follow SGLang's state machine per tag ("weights", "kv_cache", "cuda_graph"):
releasing a released tag, or resuming a resident one, is a RuntimeError (a tag that holds nothing,
like cuda_graph on the CPU, moves the same way). The memory saver (runner/memory/memory_saver.py) does
the pausing; this module keeps the runner's other state in step with it: prepacked weight shadows,
the KV pool's padding slot and request table, and which weights are valid without a CPU backup.
`free_all` frees every tensor the runner holds (weights, KV, graph buffers, prepacked copies, host
backups) in place, so the memory goes back even while something still references the runner.

Each function takes the ModelRunner (`runner`); its public methods are thin calls into these. Nothing
here knows of requests: retracting them before a release is the caller's.
"""

from __future__ import annotations

import gc

import torch

from runner.config import check_memory_tags
from runner.memory.host_backup import release_host_memory


def check_transition(runner, tags: list[str] | None, release: bool) -> list[str]:
    """The tags a release (or resume) of `tags` acts on; RuntimeError, naming them, if any is already
    released (or still resident): SGLang refuses both rather than doing nothing. None or [] means
    every tag, as in SGLang."""
    saver = runner.memory_saver
    tags = check_memory_tags(tags or None)
    if not runner.config.enable_memory_saver:
        saver.pause(tags[0])  # raises the saver's own "disabled" message
    if release:
        bad = [t for t in tags if not saver.is_resident(t)]
        if bad:
            raise RuntimeError(f"release_memory_occupation({tags}): {bad} already released; call "
                               f"resume_memory_occupation({bad}) first")
    else:
        bad = [t for t in tags if saver.is_resident(t)]
        if bad:
            raise RuntimeError(f"resume_memory_occupation({tags}): {bad} not currently released; resume "
                               f"only what release_memory_occupation released")
    return tags


def release(runner, tags: list[str] | None = None) -> None:
    """Release `tags` (None: all). Each must be resident (checked before anything is released)."""
    tags = runner.check_memory_transition(tags, release=True)
    saver = runner.memory_saver
    for tag in tags:
        saver.pause(tag)  # first: a refusal (saver disabled) must leave everything as it was
        if tag == "weights":
            runner._drop_packs()  # shadows of the weights go with them
        if tag == "kv_cache":
            runner.token_to_kv_pool.clear()
        if tag == "weights" and getattr(runner, "lora_manager", None) is not None:
            runner.lora_manager.on_weights_released(saver.has_cpu_backup("weights"))
        if tag == "cuda_graph" and getattr(runner, "piecewise_runner", None) is not None:
            runner.piecewise_runner.reset()  # ordinary torch memory: dropped now, captured again after resume
        if tag == "cuda_graph":
            _drop_unpageable_decode_graphs(runner)
        if tag == "weights" and not saver.has_cpu_backup("weights"):
            runner.weights_valid = False
            runner.invalid_weights = set(runner.name_map.hf_names())
            runner.invalid_reason = ""  # the release explains it now


def _drop_unpageable_decode_graphs(runner) -> None:
    """Decode graphs whose memory the saver cannot page (the portable saver; torch_memory_saver without its
    LD_PRELOAD hooks) are dropped with their pool, so releasing the cuda_graph tag really returns that memory;
    the first replay after the resume captures them again (CudaGraphRunner.replay)."""
    graphs = runner.graph_runner
    if graphs is None or not getattr(graphs, "released_with_cuda_graph_tag", False):
        return  # none, or the CPU's compiled step, which holds no graph memory
    if getattr(runner.memory_saver, "graphs_pauseable", False):
        return  # captured into torch_memory_saver's cuda_graph region: paused with the tag
    graphs.reset()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()


def resume(runner, tags: list[str] | None = None) -> None:
    """Resume `tags` (None: all). Each must be released (checked before anything is resumed)."""
    tags = runner.check_memory_transition(tags, release=False)
    saver = runner.memory_saver
    for tag in tags:
        saver.resume(tag)
        if tag == "kv_cache":
            # Resumed memory holds whatever was there before (NaN included). Attention reads the
            # padding slot 0 for masked positions, and 0 * NaN would poison the real ones.
            pool = runner.token_to_kv_pool
            pool.k_buffer[:, 0].zero_()
            pool.v_buffer[:, 0].zero_()
            # The request->slot table lives in the same region (torch_memory_saver hands it back
            # undefined); graph padding rows read row 0, so an out-of-range slot must never be there.
            # No request holds a row across a release (it is refused unless they are retracted).
            runner.req_to_token_pool.req_to_token.zero_()
        if tag == "weights" and getattr(runner, "lora_manager", None) is not None:
            runner.lora_manager.on_weights_resumed()
        if tag == "weights" and saver.has_cpu_backup("weights"):
            runner._repack(None)  # without backup, shadows come back module by module with updates


def free_all(runner) -> None:
    """Free every tensor `runner` holds, in place (storages resized to 0, not just dereferenced). The
    runner is unusable afterwards; its weight-update groups must already be left."""
    runner.memory_saver.close()  # maps released regions back first (freeing paused memory is unsafe)
    runner.weights_valid = False
    runner.invalid_reason = "the engine was shut down"
    runner._drop_packs()
    tensors = [*runner.model.parameters(), *runner.model.buffers()]
    if getattr(runner, "lora_manager", None) is not None:  # adapter slots are not model parameters
        tensors += [t for m in runner.lora_manager.modules.values() for t in m.tensors()]
    pw = getattr(runner, "piecewise_runner", None)
    if pw is not None:
        pw.reset()
        tensors += [v for v in (*vars(pw.inputs).values(), *vars(pw).values()) if isinstance(v, torch.Tensor)]
    for holder in (runner.token_to_kv_pool, runner.req_to_token_pool, runner.graph_runner, runner.attn_backend):
        tensors += [v for v in vars(holder).values() if isinstance(v, torch.Tensor)] if holder else []
    for t in tensors:
        t.untyped_storage().resize_(0)
    runner.memory_saver.free()
    # Graphs (and their private pools), compiled steps and backends hold more: drop them too.
    runner.graph_runner = runner.attn_backend = runner.piecewise_runner = None
    gc.collect()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
        torch.cuda.empty_cache()
    else:
        release_host_memory()
