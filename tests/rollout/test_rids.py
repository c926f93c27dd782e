"""new_rid: uuid4-format ids (what uuid.uuid4().hex gives), unique, and a forked child does not repeat its parent's."""

import os
import uuid

from rollout.rids import new_rid


def test_ids_are_version_4_uuids_in_hex():
    """Each id parses as a version-4, RFC 4122 UUID whose .hex is the id itself (SGLang's rid format)."""
    for rid in (new_rid() for _ in range(2000)):
        u = uuid.UUID(rid)
        assert (u.version, u.variant, u.hex) == (4, uuid.RFC_4122, rid)


def test_ids_do_not_repeat():
    """200,000 ids, all distinct, and their random bits vary in every hex digit but the fixed version one."""
    ids = [new_rid() for _ in range(200_000)]
    assert len(set(ids)) == len(ids)
    assert all(len({rid[i] for rid in ids[:1000]}) > 1 for i in range(32) if i != 12)


def test_a_forked_child_draws_other_ids_than_its_parent():
    """After fork the child reseeds: its next ids differ from the ones the parent draws next."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write its next ids and leave without running pytest's teardown
        os.close(r)
        os.write(w, " ".join(new_rid() for _ in range(4)).encode())
        os._exit(0)
    os.close(w)
    parent = [new_rid() for _ in range(4)]
    with os.fdopen(r) as f:
        child = f.read().split()
    os.waitpid(pid, 0)
    assert len(child) == 4 and not set(child) & set(parent)
