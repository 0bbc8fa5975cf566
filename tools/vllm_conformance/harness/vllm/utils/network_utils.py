"""Stub of vllm.utils.network_utils.get_open_port."""

import socket


def get_open_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
