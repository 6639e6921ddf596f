"""`kvpipe.bench.procrun.free_port` hands out ports a child can still bind later: below the kernel's ephemeral
range, where outgoing connections never take their local port."""
import socket

from kvpipe.bench.procrun import _ephemeral_low, free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_free():
    low = _ephemeral_low()
    ports = {free_port() for _ in range(200)}
    assert all(1024 <= p < low for p in ports)
    assert len(ports) > 100  # spread out, not one port over and over
    for p in list(ports)[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_handed_out():
    held = []
    try:
        for _ in range(50):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert all(free_port() not in taken for _ in range(500))
    finally:
        for s in held:
            s.close()
