"""Distributed receives refuse short, long and corrupt transfers; groups can be destroyed and rejoined.

Real gloo groups on 127.0.0.1: rank 0 (the sender) runs in a thread or a child process, rank 1 (the
receiver, the engine's side) in the test. Senders written like SGLang's clients are reproduced here
from their protocol, independently of weight_sync's sender: one `broadcast` per tensor in its own
dtype, or one broadcast of the tensors' bytes back to back (SGLang's flattened bucket). In the good
case the received tensors must equal the sender's bit for bit; a bad transfer must raise naming the
tensor, with nothing returned to load.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from weight_sync import distributed as wd
from weight_sync.distributed import (
    broadcast,
    broadcast_named_tensors,
    create_weight_update_group,
    destroy_weight_update_group,
    receive_named_tensors,
)

TIMEOUT_S = 20.0
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_pair(name: str = "g", timeout_s: float = TIMEOUT_S, port: int | None = None):
    """(sender group rank 0, receiver group rank 1), joined concurrently."""
    port = port or free_port()
    out = {}

    def join(rank):
        out[rank] = create_weight_update_group("127.0.0.1", port, rank, 2, name, "gloo", timeout_s)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    assert set(out) == {0, 1}
    return out[0], out[1]


@pytest.fixture
def pair():
    sender, receiver = join_pair()
    yield sender, receiver
    destroy_weight_update_group(sender)
    destroy_weight_update_group(receiver)


class Sender(threading.Thread):
    """Runs `fn(group)` on rank 0 in a thread; `.join_checked()` re-raises its error."""

    def __init__(self, group, fn) -> None:
        super().__init__(daemon=True)
        self.group, self.fn, self.error = group, fn, None
        self.start()

    def run(self) -> None:
        try:
            self.fn(self.group)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            self.error = e

    def join_checked(self) -> None:
        self.join(TIMEOUT_S + 5)
        assert not self.is_alive()
        if self.error is not None:
            raise self.error


def weights():
    """Mixed dtypes, odd byte counts (misaligned offsets in a bucket), a scalar and an empty tensor."""
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 5, generator=g)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(3, 3, generator=g).to(torch.bfloat16)),
        ("model.layers.0.step", torch.tensor(123456789, dtype=torch.int64)),
        ("model.layers.0.mask", torch.tensor([True, False, True])),
        ("model.layers.0.input_layernorm.weight", torch.randn(5, generator=g).to(torch.float16)),
        ("model.empty", torch.zeros(0, 4)),
        ("model.layers.0.q_scale", torch.randint(-100, 100, (9,), generator=g, dtype=torch.int32)),
        ("model.norm.weight", torch.randn(6, generator=g)),
    ]


def spec(named):
    return [n for n, _ in named], [str(t.dtype).removeprefix("torch.") for _, t in named], \
        [list(t.shape) for _, t in named]


def assert_bit_equal(got, want) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


def sglang_per_tensor(named):
    """SGLang's default sender (slime, verl): one broadcast per tensor, each in its own dtype."""
    return lambda group: [broadcast(group, t.contiguous()) for _, t in named]


def sglang_bucket_bytes(named) -> torch.Tensor:
    """SGLang's flattened bucket: every tensor's bytes, back to back, in order."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in named])


# ---------------------------------------------------------------------------------------------
# what gloo itself does


def test_gloo_accepts_short_broadcasts_silently(pair):
    """gloo semantics the receiver is built around: bytes, not dtypes, must agree, and a sender that
    sends fewer bytes than the receiver's buffer gets no error anywhere, the tail left untouched."""
    sender, receiver = pair
    t = Sender(sender, lambda g: broadcast(g, torch.arange(4, dtype=torch.float32)))
    buf = torch.full((24,), 0xAB, dtype=torch.uint8)
    broadcast(receiver, buf)
    t.join_checked()
    assert torch.equal(buf[:16].view(torch.float32), torch.arange(4, dtype=torch.float32))
    assert buf[16:].tolist() == [0xAB] * 8


def test_gloo_aborts_the_receiver_on_long_broadcasts():
    """The other half: a sender that sends MORE bytes than the receiver's buffer kills the receiving
    process (SIGABRT from gloo's enforce), with no exception to catch; hence the receive windows."""
    code = textwrap.dedent(f"""
        import threading, torch
        from weight_sync.distributed import create_weight_update_group, broadcast
        port = {free_port()}
        groups = {{}}
        def join(r): groups[r] = create_weight_update_group("127.0.0.1", port, r, 2, "g", "gloo", 10)
        ts = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
        [t.start() for t in ts]; [t.join() for t in ts]
        threading.Thread(target=broadcast, args=(groups[0], torch.ones(16)), daemon=True).start()
        try:
            broadcast(groups[1], torch.zeros(8))
        except Exception as e:
            print("raised", e)
        print("survived")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == -6, (proc.returncode, proc.stdout, proc.stderr[-500:])
    assert "survived" not in proc.stdout
    assert "doesn't match expected size" in proc.stderr


# ---------------------------------------------------------------------------------------------
# the good case, every format


@pytest.mark.parametrize("load_format", [None, "flattened_bucket", "checked_bucket"])
def test_round_trip_is_bit_exact_in_every_format(pair, load_format):
    """broadcast_named_tensors -> receive_named_tensors delivers every tensor bit for bit, mixed dtypes
    included, in all three wire formats."""
    sender, receiver = pair
    named = weights()
    t = Sender(sender, lambda g: broadcast_named_tensors(g, named, load_format))
    got = receive_named_tensors(receiver, *spec(named), "cpu", load_format=load_format)
    t.join_checked()
    assert_bit_equal(got, named)


def test_sglang_senders_are_received(pair):
    """Senders written for SGLang (reproduced here from the protocol) work: per-tensor broadcasts, and
    one flattened-bucket broadcast of the bytes; dtypes may be given as torch.dtype too."""
    sender, receiver = pair
    named = weights()
    t = Sender(sender, sglang_per_tensor(named))
    got = receive_named_tensors(receiver, *spec(named), "cpu")
    t.join_checked()
    assert_bit_equal(got, named)

    t = Sender(sender, lambda g: broadcast(g, sglang_bucket_bytes(named)))
    names, _, shapes = spec(named)
    got = receive_named_tensors(receiver, names, [x.dtype for _, x in named], shapes, "cpu",
                                load_format="flattened_bucket")
    t.join_checked()
    assert_bit_equal(got, named)


# ---------------------------------------------------------------------------------------------
# short and long transfers, SGLang formats


def truncated(named, index: int, num_elements: int):
    """`named` with tensor `index` cut to its first `num_elements` elements (what a buggy sender sends)."""
    out = list(named)
    name, t = out[index]
    out[index] = (name, t.reshape(-1)[:num_elements].clone())
    return out


@pytest.mark.parametrize("index, keep", [(0, 34), (1, 0), (2, 0), (6, 7), (7, 5)],
                         ids=["float32-1-short", "bf16-empty", "int64-scalar", "int32-2-short", "last-1-short"])
def test_short_per_tensor_broadcast_is_refused_naming_the_tensor(pair, index, keep):
    """A per-tensor sender that sends fewer elements than announced for one tensor is refused, with
    that tensor's name, whatever its dtype; the group stays in step for the next, good transfer."""
    sender, receiver = pair
    named = weights()
    t = Sender(sender, sglang_per_tensor(truncated(named, index, keep)))
    with pytest.raises(ValueError, match=f"{named[index][0]!r}.*fewer bytes"):
        receive_named_tensors(receiver, *spec(named), "cpu")
    t.join_checked()
    t = Sender(sender, sglang_per_tensor(named))
    assert_bit_equal(receive_named_tensors(receiver, *spec(named), "cpu"), named)
    t.join_checked()


@pytest.mark.parametrize("missing_bytes, where", [(4, 7), (8, 7), (24, 7), (40, 6), (119, 0)])
def test_short_bucket_broadcast_is_refused_naming_where_it_ended(pair, missing_bytes, where):
    """A flattened-bucket sender that sends fewer bytes than the layout needs is refused, naming the
    first tensor the transfer did not fill."""
    sender, receiver = pair
    named = weights()
    payload = sglang_bucket_bytes(named)
    t = Sender(sender, lambda g: broadcast(g, payload[: payload.numel() - missing_bytes].clone()))
    with pytest.raises(ValueError, match=f"{named[where][0]!r}.*fewer bytes"):
        receive_named_tensors(receiver, *spec(named), "cpu", load_format="flattened_bucket")
    t.join_checked()


def test_long_transfers_are_refused_and_the_receiver_survives(pair):
    """A sender that broadcasts more than announced (a tensor, or the whole bucket) is refused naming
    the tensor, and the receiving process lives on (the window caught the extra bytes)."""
    sender, receiver = pair
    named = weights()
    longer = list(named)
    longer[3] = (named[3][0], torch.tensor([True, False, True, True]))  # one element too many
    t = Sender(sender, sglang_per_tensor(longer))
    with pytest.raises(ValueError, match="'model.layers.0.mask'.*more than the 3 bytes"):
        receive_named_tensors(receiver, *spec(named), "cpu")
    t.join_checked()
    longer[-1] = (named[-1][0], torch.randn(40))  # the last tensor: its window is the slack
    t = Sender(sender, sglang_per_tensor(named[:-1] + longer[-1:]))
    with pytest.raises(ValueError, match="'model.norm.weight'.*more than"):
        receive_named_tensors(receiver, *spec(named), "cpu")
    t.join_checked()
    payload = sglang_bucket_bytes(named)
    t = Sender(sender, lambda g: broadcast(g, torch.cat([payload, payload[:16]])))
    with pytest.raises(ValueError, match="the bucket.*more than"):
        receive_named_tensors(receiver, *spec(named), "cpu", load_format="flattened_bucket")
    t.join_checked()


# ---------------------------------------------------------------------------------------------
# checked_bucket: header, payload, checksums


def checked_sender(named, payload=None, layout_of=None):
    """Our checked_bucket sender, with one thing falsified: the payload or the layout hash."""
    specs = wd._specs(*spec(named))
    real = sglang_bucket_bytes(named)
    payload = real if payload is None else payload
    layout = wd._layout_hash(wd._specs(*spec(layout_of)) if layout_of else specs)
    header = torch.tensor([wd._MAGIC, wd._VERSION, payload.numel(), len(specs),
                           layout, 0], dtype=torch.int64)
    trailer = torch.tensor(wd._checksums(real, specs), dtype=torch.int64)
    return lambda g: [broadcast(g, x) for x in (header, payload, trailer)]


def test_checked_bucket_refuses_corruption_wrong_count_and_wrong_layout(pair):
    """checked_bucket names the corrupted tensor (one flipped byte), refuses a payload shorter than
    announced by the layout, and a same-size payload with other shapes; each time the next good
    transfer still works (the receiver took exactly what the header announced)."""
    sender, receiver = pair
    named = weights()
    total = sum(t.numel() * t.element_size() for _, t in named)
    corrupt = sglang_bucket_bytes(named).clone()
    start = sum(t.numel() * t.element_size() for _, t in named[:4])
    corrupt[start + 7] ^= 1  # byte 7 of the 'model.layers.0.input_layernorm.weight' region
    cases = [
        (checked_sender(named, payload=corrupt), "'model.layers.0.input_layernorm.weight'.*checksum"),
        (checked_sender(named, payload=sglang_bucket_bytes(named)[:-8].clone()),
         f"sent {total - 8} bytes in 8 tensors.*describe {total} bytes"),
        (checked_sender(named, layout_of=[(n, t.reshape(-1)) for n, t in named]), "differ"),
    ]
    for fn, pattern in cases:
        t = Sender(sender, fn)
        with pytest.raises(ValueError, match=pattern):
            receive_named_tensors(receiver, *spec(named), "cpu", load_format="checked_bucket")
        t.join_checked()
        t = Sender(sender, lambda g: broadcast_named_tensors(g, named, "checked_bucket"))
        assert_bit_equal(receive_named_tensors(receiver, *spec(named), "cpu", load_format="checked_bucket"), named)
        t.join_checked()


def test_checked_bucket_refuses_a_sender_of_another_protocol():
    """A per-tensor sender talking to a checked_bucket receiver is detected by the header's magic."""
    sender, receiver = join_pair()
    named = [("a", torch.zeros(6, dtype=torch.int64)), ("b", torch.ones(2))]
    t = Sender(sender, sglang_per_tensor(named))
    try:
        with pytest.raises(RuntimeError, match="not this protocol's header"):
            receive_named_tensors(receiver, *spec(named), "cpu", load_format="checked_bucket")
    finally:
        destroy_weight_update_group(receiver)  # out of step now: the sender's next broadcast fails fast
        t.join(TIMEOUT_S + 5)
        destroy_weight_update_group(sender)
    assert not t.is_alive()


def test_bad_specs_are_refused_before_receiving(pair):
    """Names/dtypes/shapes are checked before anything is received, naming the entry."""
    _, receiver = pair
    with pytest.raises(ValueError, match="same length"):
        receive_named_tensors(receiver, ["a", "b"], ["float32"], [[1], [2]], "cpu")
    with pytest.raises(ValueError, match="'b'.*unknown dtype"):
        receive_named_tensors(receiver, ["a", "b"], ["float32", "float13"], [[1], [2]], "cpu")
    with pytest.raises(ValueError, match="'a'.*shape"):
        receive_named_tensors(receiver, ["a"], ["float32"], [[-1]], "cpu")
    with pytest.raises(ValueError, match="load_format"):
        receive_named_tensors(receiver, ["a"], ["float32"], [[1]], "cpu", load_format="pickle")


# ---------------------------------------------------------------------------------------------
# dead and silent senders; destroy and rejoin

SENDER_SCRIPT = textwrap.dedent("""
    import sys, time
    from weight_sync.distributed import create_weight_update_group
    port, name = int(sys.argv[1]), sys.argv[2]
    g = create_weight_update_group("127.0.0.1", port, 0, 2, name, "gloo", 30)
    print("joined", flush=True)
    time.sleep(60)
""")


def spawn_sender(port: int, name: str) -> subprocess.Popen:
    """A trainer process that joins the group as rank 0 (hosting the store) and then idles."""
    return subprocess.Popen([sys.executable, "-c", SENDER_SCRIPT, str(port), name],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)


def join_receiver(port: int, name: str, timeout_s: float):
    return create_weight_update_group("127.0.0.1", port, 1, 2, name, "gloo", timeout_s)


def test_killed_sender_is_noticed_at_once_and_the_name_and_port_can_be_reused():
    """A SIGKILLed trainer fails the engine's receive within seconds, not at the 60 s timeout; after
    destroy_weight_update_group the same group name and port join a new trainer whose bytes arrive."""
    port, name = free_port(), "policy"
    proc = spawn_sender(port, name)
    try:
        group = join_receiver(port, name, timeout_s=60)
        assert proc.stdout.readline().strip() == "joined"
        killer = threading.Timer(0.5, proc.kill)
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="(?i)closed|reset|peer"):
            receive_named_tensors(group, ["w"], ["float32"], [[6]], "cpu")
        assert time.monotonic() - t0 < 10
        killer.join()
    finally:
        proc.kill()
        proc.wait()
    destroy_weight_update_group(group)
    destroy_weight_update_group(group)  # idempotent
    with pytest.raises(RuntimeError, match="destroyed"):
        receive_named_tensors(group, ["w"], ["float32"], [[6]], "cpu")

    sender, receiver = join_pair(name, timeout_s=10, port=port)  # a new trainer, same name and port
    try:
        t = Sender(sender, lambda g: broadcast(g, torch.arange(6, dtype=torch.float32) * 1.5))
        (got_name, got), = receive_named_tensors(receiver, ["w"], ["float32"], [[6]], "cpu")
        t.join_checked()
        assert got_name == "w" and torch.equal(got, torch.arange(6, dtype=torch.float32) * 1.5)
    finally:
        destroy_weight_update_group(sender)
        destroy_weight_update_group(receiver)


def test_silent_sender_times_out_at_timeout_s(pair):
    """A live sender that never broadcasts fails the receive after `timeout_s`, not the group's 20 s."""
    _, receiver = pair
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="(?i)timed out|timeout"):
        receive_named_tensors(receiver, ["w"], ["float32"], [[4]], "cpu", timeout_s=1.0)
    assert 0.8 < time.monotonic() - t0 < 8


def test_destroy_frees_the_port_for_a_new_group_in_process():
    """Destroying both ends of a group (rank 0 hosts the store) frees its port: the same name and
    port form a new group at once, and it carries bytes."""
    port = free_port()
    for value in (1.0, 2.0):
        sender, receiver = join_pair("same", timeout_s=10, port=port)
        t = Sender(sender, lambda g, v=value: broadcast(g, torch.full((3,), v)))
        (_, got), = receive_named_tensors(receiver, ["x"], ["float32"], [[3]], "cpu")
        t.join_checked()
        assert got.tolist() == [value] * 3
        destroy_weight_update_group(sender)
        destroy_weight_update_group(receiver)
        assert sender.process_group is None and sender.store is None


def test_a_peer_that_accepts_but_never_answers_fails_the_join_in_time():
    """Something else on the master port (accepts, never speaks the store's protocol): the join fails with a
    TimeoutError naming the address shortly after timeout_s, instead of blocking in torch's handshake."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=f"rendezvous store at 127.0.0.1:{port}"):
            create_weight_update_group("127.0.0.1", port, 1, 2, "silent", "gloo", timeout_s=2)
        assert time.monotonic() - t0 < 2 + 1.5 + 1.0  # the deadline, its grace, and slack for a loaded machine
