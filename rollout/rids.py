"""Request ids: `new_rid()`, a random version-4 UUID's 32 hex digits (what `uuid.uuid4().hex` gives, SGLang's
rid format), drawn from a per-process generator instead of the kernel.

uuid4 reads 16 bytes from os.urandom, one getrandom syscall per id: 3-14 us on the machines here, for every
request an engine makes, on the path between a finished request and its successor's admission. A Mersenne
Twister seeded from os.urandom gives the same 122 random bits per id in well under a microsecond. The ids are
names, not secrets (a client can pick its own rid), so an unpredictable generator is not needed; uniqueness is
what counts, and a forked child reseeds (os.register_at_fork) so that it never repeats its parent's sequence.

What it does not do: check for collisions (2^-61 odds at a billion ids, as uuid4's).
"""

from __future__ import annotations

import os
import random

_rng = random.Random(os.urandom(32))

# The version (4) and variant (RFC 4122) bits of a UUID, as uuid.UUID(version=4) sets them.
_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_SET = (0x4000 << 64) | (0x8000 << 48)


def _reseed() -> None:
    _rng.seed(os.urandom(32))


os.register_at_fork(after_in_child=_reseed)


def new_rid() -> str:
    """A fresh request id: 32 lowercase hex digits of a random version-4 UUID."""
    return f"{(_rng.getrandbits(128) & _CLEAR) | _SET:032x}"
