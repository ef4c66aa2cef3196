"""Scatter/gather socket loops: many views, partial sends (small socket buffers), peer close, deadline."""

import socket
import threading
import time

import numpy as np
import pytest

from kvplugins.transfer.sockio import IOV_MAX, recv_views, send_all


def _pair():
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return a, b


def test_many_views_round_trip_exactly():
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 3000, size=IOV_MAX * 2 + 7)
    data = np.frombuffer(rng.bytes(int(sizes.sum())), dtype=np.uint8)
    cuts = np.concatenate([[0], np.cumsum(sizes)])
    src = [data[cuts[i] : cuts[i + 1]] for i in range(len(sizes))]
    out = np.zeros_like(data)
    dst = [out[cuts[i] : cuts[i + 1]] for i in range(len(sizes))]
    a, b = _pair()
    with a, b:
        sender = threading.Thread(target=send_all, args=(a, src))
        sender.start()
        recv_views(b, dst)
        sender.join(10)
    assert np.array_equal(out, data)


def test_peer_close_mid_message_raises_connection_error():
    a, b = _pair()
    with b:
        a.sendall(b"x" * 10)
        a.close()
        with pytest.raises(ConnectionError, match="bytes still expected"):
            recv_views(b, [bytearray(5), bytearray(20)])


def test_trickling_peer_stops_at_the_deadline():
    a, b = _pair()
    with a, b:
        b.settimeout(0.2)
        stop = threading.Event()

        def trickle():
            while not stop.is_set():
                a.send(b"x")
                time.sleep(0.05)

        t = threading.Thread(target=trickle)
        t.start()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            recv_views(b, [bytearray(1000)], deadline=time.monotonic() + 0.3)
        stop.set()
        t.join()
    assert time.monotonic() - t0 < 0.6
