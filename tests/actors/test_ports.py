import random
import socket

from actors.ports import _FIRST, _ephemeral_start, free_port, free_ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(_FIRST <= p < _ephemeral_start() for p in ports)
    socks = [socket.socket() for _ in ports]
    try:
        for s, p in zip(socks, ports, strict=True):
            s.bind(("127.0.0.1", p))
    finally:
        for s in socks:
            s.close()


def test_a_port_in_use_is_skipped():
    taken = random.Random(7).randrange(_FIRST, _ephemeral_start())
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        (port,) = free_ports(1, rng=random.Random(7))
    assert port != taken


def test_free_port_is_one_of_them():
    assert _FIRST <= free_port() < _ephemeral_start()
