"""SGLang's weight checker, on one runner: snapshot every parameter, overwrite them all, compare exactly.

The check-weight-update mode of RL frameworks (slime) proves a weight sync writes every tensor: snapshot
the weights, overwrite each parameter with random values, run the sync, compare against the snapshot.
`snapshot` copies the model's parameters (runner names, tied tensors once) to the host; `reset` draws
new values for every parameter through the runner's one writer (routes.write), so the prepacked
shadows and the cached checksums follow, and a reset that fails half-way marks the weights invalid;
`compare` checks each parameter against the snapshot with torch.equal, one parameter at a time, so it
never holds more than the snapshot plus one parameter's host copy.

What it does not do: LoRA adapter weights (not model parameters), tensor-parallel ranks (the Engine
refuses tp_size > 1), or anything about requests and caches (the Engine's).
"""

from __future__ import annotations

import hashlib

import torch

from runner.weights import routes
from runner.weights.loader import WeightsCorruptedError, WeightWriter

MIN_RESET_STD = 0.01  # a constant parameter (a norm's ones) still gets values that differ from it


@torch.no_grad()
def snapshot(runner) -> dict[str, torch.Tensor]:
    """A host copy of every model parameter, by runner parameter name."""
    routes.require_weights_resident(runner)
    return {name: p.detach().to("cpu", copy=True) for name, p in runner.name_map.params.items()}


@torch.no_grad()
def reset(runner, seed: int) -> int:
    """Overwrite every parameter with random values of its own mean and spread (at least MIN_RESET_STD),
    drawn on its device from `seed`. Returns how many parameters were written."""
    routes.require_weights_resident(runner)
    params = runner.name_map.params
    gen = torch.Generator(device=runner.device).manual_seed(seed)

    def fill(writer: WeightWriter) -> None:
        # No undo snapshot (it would be a second copy of the model): a reset that fails half-way has
        # destroyed the weights either way, so routes.write marks them invalid and generate refuses.
        for name, p in params.items():
            writer.written.add(name)
            try:
                as_float = p.float()
                std = max(float(as_float.std()) if p.numel() > 1 else 0.0, MIN_RESET_STD)
                p.copy_(torch.empty_like(as_float).normal_(float(as_float.mean()), std, generator=gen))
            except Exception as e:
                raise WeightsCorruptedError(f"reset_tensors failed at {name!r} ({type(e).__name__}: {e})",
                                            set(writer.written)) from e

    return routes.write(runner, fill, repack_all=True)


@torch.no_grad()
def compare(runner, reference: dict[str, torch.Tensor]) -> tuple[list[tuple[str, str]], int]:
    """-> ((name, what differs) for each parameter whose value, shape or dtype differs from `reference`,
    or that only one side has, in name order; how many parameters were compared). A value difference
    reads "max_abs_err=<float>" (SGLang's wording)."""
    routes.require_weights_resident(runner)
    params = runner.name_map.params
    differ = [(n, "missing from the snapshot" if n in params else "no longer a parameter")
              for n in sorted(set(reference) ^ set(params))]
    for name, p in params.items():
        ref = reference.get(name)
        if ref is None:
            continue
        if ref.dtype != p.dtype or ref.shape != p.shape:
            differ.append((name, f"{p.dtype} {tuple(p.shape)} against the snapshot's {ref.dtype} {tuple(ref.shape)}"))
            continue
        # On the CPU the parameter itself; on a device one parameter's host copy at a time.
        cur = p.detach().to("cpu")
        if not torch.equal(cur, ref):
            differ.append((name, f"max_abs_err={(cur.double() - ref.double()).abs().max().item():.6g}"))
    return sorted(differ), len(params)


@torch.no_grad()
def checksums(runner) -> dict[str, str]:
    """Runner parameter name -> 16 hex digits (BLAKE2b-64 of dtype, shape and bytes): SGLang's per-tensor
    "checksum" action. Parameters only: non-persistent buffers (rotary tables) are not weights."""
    routes.require_weights_resident(runner)
    out = {}
    for name, p in sorted(runner.name_map.params.items()):
        h = hashlib.blake2b(digest_size=8)
        _hash_tensor(h, p)
        out[name] = h.hexdigest()
    return out


def _hash_tensor(h, p: torch.Tensor) -> None:
    """Feed `h` the tensor's dtype, shape and bytes (of a host copy: exporting the parameter's own storage
    would pin it, and a release resizes it)."""
    t = p.detach().to("cpu").contiguous()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(-1).view(torch.uint8).clone().numpy().tobytes())


@torch.no_grad()
def parameters_sha256(model: torch.nn.Module) -> tuple[str, int]:
    """(SHA-256 hex over every parameter of `model`: name, dtype, shape, bytes, in name order; how many).
    Equal digests mean bitwise-equal parameters. On one tensor-parallel rank: that rank's slices."""
    h = hashlib.sha256()
    params = sorted(model.named_parameters())
    for name, p in params:
        h.update(f"{name}|".encode())
        _hash_tensor(h, p)
    return h.hexdigest(), len(params)
