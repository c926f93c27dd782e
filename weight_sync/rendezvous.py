"""Reach a weight-update group's master before torch's TCPStore tries to, within one deadline.

torch's TCPStore client retries its connect with back-off and overshoots its timeout (measured on torch
2.13: 5.8 s for a 3 s timeout to a closed port, 7.2 s for an unresolvable name; a 120 s join took ~225 s),
and a name whose resolution hangs blocks it for as long as the resolver does. `wait_for_master` resolves
the name in a helper thread bounded by the deadline, then retries a plain TCP connect until the master
listens (a trainer usually starts its store at about the same time as it asks the engine to join), and
raises TimeoutError naming what it waited for. The TCPStore is then given only the time left.

It does not talk the store's protocol: a connect that succeeds is closed at once (the store's server
drops such a connection silently). Something that accepts and then never answers the store's handshake
(another program on that port) would hold torch's client past any timeout: `bounded` runs the store's
construction in a daemon thread and gives up at the deadline (the thread is left to the OS; a store it
builds after that is dropped).
"""

from __future__ import annotations

import socket
import threading
import time

RETRY_S = 0.2


def resolve(host: str, port: int, timeout_s: float) -> list[tuple]:
    """getaddrinfo, bounded: the resolver call cannot be cancelled (see `bounded`)."""
    try:
        return bounded(lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout_s,
                       f"resolving {host!r}")
    except TimeoutError:
        raise
    except OSError as e:
        raise ConnectionError(f"cannot resolve master_address {host!r}: {e}") from None


def wait_for_master(host: str, port: int, timeout_s: float) -> float:
    """Block until `host:port` accepts a TCP connection; -> the seconds left of `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    infos = resolve(host, port, timeout_s)
    last: OSError | None = None
    while True:
        for family, kind, proto, _, addr in infos:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                with socket.socket(family, kind, proto) as s:
                    s.settimeout(min(left, 5.0))
                    s.connect(addr)
                return max(deadline - time.monotonic(), 0.1)
            except OSError as e:
                last = e
        if time.monotonic() + RETRY_S >= deadline:
            raise TimeoutError(f"nothing accepted a connection at {host}:{port} within {timeout_s:.1f} s "
                               f"(last error: {last}); is the trainer's rank 0 up?")
        time.sleep(RETRY_S)


def bounded(fn, timeout_s: float, what: str):
    """fn() within `timeout_s`, else TimeoutError naming `what`. fn cannot be cancelled (a C++ call blocked
    on a socket), so it runs in a daemon thread; a result that arrives after the deadline is discarded."""
    result: list = []
    done = threading.Event()

    def run():
        try:
            result.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            result.append((False, e))
        done.set()

    threading.Thread(target=run, name="rollout-rendezvous", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"{what} took longer than {timeout_s:.1f} s")
    ok, value = result[0]
    if not ok:
        raise value
    return value
