"""Bit patterns of float tensors and the additive per-tensor checksum that sparse deltas are checked by.

The base checksum (`tensor_hash`) is additive over elements: two sums mod P = 2^31 - 1 of terms that
weight each element's bits by pseudo-random multipliers of its global index (a per-offset factor
within a block of 4096, times a per-block factor). So it is cheap to keep current: a receiver that
changes k elements updates its cached hash in O(k), and under tensor parallelism each rank's slice
contributes a partial sum that adds up to the whole tensor's. A full hash is one float64
matrix-vector product per block row (exact: every partial sum stays below 2^53). It is not a
cryptographic hash: it guards against mistakes (a full update in between, another trainer, a
restart), not adversaries.

Used by weight_sync/delta_codec.py (the format) and runner/weights/delta.py (the receiver's cache).
Not here: encoding or decoding a delta.
"""

from __future__ import annotations

import torch

# float dtype -> (signed int dtype of the same width, bit width)
BIT_DTYPES = {torch.float32: (torch.int32, 32), torch.bfloat16: (torch.int16, 16), torch.float16: (torch.int16, 16)}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}

_P = (1 << 31) - 1
_M31 = (1 << 31) - 1


class DeltaFormatError(ValueError):
    """A delta blob or entry that is malformed (names what and where)."""


# ---- bit patterns -----------------------------------------------------------------------------------
def check_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in BIT_DTYPES:
        raise DeltaFormatError(f"{what}: dtype {dtype} has no delta encoding (supported: "
                               f"{sorted(DTYPE_NAMES.values())})")


def to_bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit patterns read as signed integers of its width, in int64, flattened. [N] int64"""
    return t.reshape(-1).view(BIT_DTYPES[t.dtype][0]).to(torch.int64)


def from_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Signed bit patterns (int64, in the width's range) -> float tensor of `dtype` with exactly those bits."""
    return bits.to(BIT_DTYPES[dtype][0]).view(dtype)


# ---- the additive checksum --------------------------------------------------------------------------
# A pattern is split into 16-bit words w (one for 16-bit dtypes, lo and hi for 32-bit), each read as a
# signed int16 and mapped to u = w + 32769 in [1, 65536]. term_h(i) = (sum over words u * R[h][word][i % B])
# * S_h(i // B) mod P. R values are < 2^14, so a block's inner sum (B = 4096 elements, 2 words, each
# < 2^31) is exact in float64: a whole tensor hashes as one float64 matrix-vector product per hash,
# then one multiply by S per block; and a change (du * R * S, |du| < 2^16) fits int64 unreduced.
_B = 4096
_CHUNK_BLOCKS = 1024  # blocks per step of a full hash: bounds the float64 temporaries (~32-64 MB)
_OFF = 32769


def _mix(idx: torch.Tensor) -> torch.Tensor:
    """A pseudo-random non-negative value < 2^31 per int64 index."""
    x = ((idx ^ (idx >> 31)) + 0x2545F491) & _M31
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M31  # < 2^31 * 2^30: no int64 overflow
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _M31
    return x ^ (x >> 15)


# _R[h]: [B, 2] multipliers (word lo, word hi) of hash h
_R = [torch.stack([_mix(torch.arange(_B, dtype=torch.int64) + (4 * h + w + 1) * 0x10000) % ((1 << 14) - 1) + 1
                   for w in (0, 1)], 1) for h in (0, 1)]
_R64 = [r.to(torch.float64) for r in _R]
_RCUM = [torch.cat([r.new_zeros(1, 2), torch.cumsum(r, 0)]) for r in _R]  # [B + 1, 2] prefix sums


_S: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * 2  # per-block multipliers, grown on demand


def _block_mult(h: int, blk: torch.Tensor) -> torch.Tensor:
    """S_h(block) for int64 block indices (a table lookup; the table grows to the largest block seen)."""
    if blk.numel() == 0:
        return blk
    need = int(blk.max()) + 1
    if need > _S[h].numel():
        n = max(need, 2 * _S[h].numel(), 1 << 12)
        _S[h] = _mix(torch.arange(n, dtype=torch.int64) * 2 + h + (1 << 40)) % (_P - 1) + 1
    return _S[h][blk]


def _words(bits: torch.Tensor, width: int) -> torch.Tensor:
    """Signed patterns -> [k, width // 16] int64 words (each read as a signed int16) mapped to [1, 65536]."""
    if width == 16:
        return bits[:, None] + _OFF
    lo = bits & 0xFFFF
    lo = torch.where(lo >= 1 << 15, lo - (1 << 16), lo)
    return torch.stack([lo, bits >> 16], 1) + _OFF  # an arithmetic shift: the high word, signed


def hash_terms(idx: torch.Tensor, bits: torch.Tensor, width: int) -> tuple[int, int]:
    """(sum term_0, sum term_1) mod P over elements with global indices `idx`, signed `width`-bit
    patterns `bits`."""
    if idx.numel() == 0:
        return 0, 0
    u = _words(bits, width)  # [k, nw]
    nw = u.shape[1]
    j, blk = idx % _B, idx // _B
    out = []
    for h in (0, 1):
        inner = (u * _R[h][j, :nw]).sum(1) % _P  # < 2^37
        out.append(int(((inner * _block_mult(h, blk)) % _P).sum()) % _P)  # k terms < 2^31 each
    return out[0], out[1]


def hash_change(idx: torch.Tensor, old_bits: torch.Tensor, new_bits: torch.Tensor, width: int) -> tuple[int, int]:
    """hash_terms(idx, new) - hash_terms(idx, old), mod P, sharing the index work (one pass)."""
    if idx.numel() == 0:
        return 0, 0
    j, blk = idx % _B, idx // _B
    out = []
    if width == 16:  # one word: du is the pattern difference itself, |du| < 2^16
        du = new_bits - old_bits
        for h in (0, 1):  # |du * R * S| < 2^16 * 2^14 * 2^31: no overflow before the reduction
            out.append(int((du * _R[h][j, 0] * _block_mult(h, blk) % _P).sum()) % _P)
        return out[0], out[1]
    du = _words(new_bits, width) - _words(old_bits, width)  # [k, 2], in (-2^16, 2^16)
    for h in (0, 1):
        inner = (du * _R[h][j]).sum(1)  # |inner| < 2^31
        out.append(int((inner * _block_mult(h, blk) % _P).sum()) % _P)  # torch's % is >= 0 here
    return out[0], out[1]


def combine(h: int, add: tuple[int, int], sub: tuple[int, int] = (0, 0)) -> int:
    """h + add - sub for packed hashes (a << 31 | b); `add`/`sub` are (a, b) partial sums."""
    a, b = h >> 31, h & _M31
    return (((a + add[0] - sub[0]) % _P) << 31) | ((b + add[1] - sub[1]) % _P)


def tensor_hash(t: torch.Tensor, index_of=None) -> int:
    """The checksum of `t`'s bits (packed a << 31 | b). `index_of(start, end)` gives the global
    indices of t's flat elements start..end (a tensor-parallel slice); default: their own indices."""
    check_dtype(t.dtype, "tensor_hash")
    int_dtype, width = BIT_DTYPES[t.dtype]
    nw = width // 16
    flat = t.detach().reshape(-1)
    n = flat.numel()
    h = 0
    step = _CHUNK_BLOCKS * _B
    if index_of is not None:  # arbitrary indices: term by term, in chunks
        for start in range(0, n, step):
            end = min(start + step, n)
            h = combine(h, hash_terms(index_of(start, end), to_bits(flat[start:end]), width))
        return h
    words = flat.to("cpu").view(torch.int16)  # [n * nw], little-endian: lo word first
    buf = torch.zeros(min(step, -(-n // _B) * _B) * nw, dtype=torch.float64)
    for start in range(0, n, step):
        end = min(start + step, n)
        nblk = (end - start + _B - 1) // _B
        m = buf[: nblk * _B * nw]
        m.zero_()  # padding words contribute 0 ...
        m[: (end - start) * nw].copy_(words[start * nw: end * nw])
        m = m.view(nblk, _B * nw)
        blk = torch.arange(start // _B, start // _B + nblk, dtype=torch.int64)
        valid = torch.full((nblk,), _B, dtype=torch.int64)
        valid[-1] = end - start - (nblk - 1) * _B
        parts = []
        for k in (0, 1):
            inner = (m @ _R64[k][:, :nw].reshape(-1)).to(torch.int64)  # exact: < 2^49 in magnitude
            inner = inner + _OFF * _RCUM[k][valid, :nw].sum(1)  # ... and the offset only for real words
            parts.append(int(((inner % _P) * _block_mult(k, blk) % _P).sum()) % _P)
        h = combine(h, (parts[0], parts[1]))
    return h
