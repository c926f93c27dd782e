"""What to tell a user whose NCCL weight-update group puts the trainer and the engine on one GPU.

NCCL refuses a communicator with two ranks on the same device ("Duplicate GPU detected",
ncclInvalidUsage), so a trainer co-located with its engine cannot broadcast to it. The error comes
from inside torch.distributed, at the group's first collective (NCCL communicators are created
lazily), and says nothing about the alternatives. `explain_nccl_error` turns it into one that names
the problem and the paths that work on one GPU. It does not detect anything before NCCL does.
"""

from __future__ import annotations

from runner.weights.loader import WeightUpdateError

DUPLICATE_GPU_MARKERS = ("Duplicate GPU detected", "ncclInvalidUsage", "invalid usage")


def explain_nccl_error(exc: BaseException, device, group_name: str) -> WeightUpdateError | None:
    """A WeightUpdateError with advice when `exc` is NCCL refusing two ranks on one GPU, else None."""
    text = str(exc)
    if not any(m.lower() in text.lower() for m in DUPLICATE_GPU_MARKERS):
        return None
    first = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
    return WeightUpdateError(
        f"weight update group {group_name!r}: NCCL refuses two ranks on the same GPU ({device}; {first}). "
        f"A trainer on the engine's GPU cannot use an NCCL broadcast group: send the weights with "
        f"update_weights_from_tensor instead (in-process Engine; RemoteEngine with weight_transport='cuda_ipc'; "
        f"or the server's /update_weights_from_tensor with load_format='cuda_ipc'), all without a host copy, "
        f"or join with backend='gloo' (through host memory)")
