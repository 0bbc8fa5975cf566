"""Engine-core addresses and sockets.

Addresses are `ipc:///absolute/path` or `tcp://host:port`. Nothing here is hard-coded: a
client that spawns its engine core puts the ipc socket in a fresh private directory
(`tempfile.mkdtemp`, mode 0700); tcp binds to 127.0.0.1 unless the address names a host.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from dataclasses import dataclass

import zmq

IPC_SOCKET_NAME = "engine.sock"


@dataclass(frozen=True, slots=True)
class EngineAddress:
    address: str  # normalized: ipc:///abs/path or tcp://host:port
    private_dir: str | None = None  # a private directory we created (removed on cleanup)

    @property
    def ipc_path(self) -> str | None:
        return self.address[len("ipc://"):] if self.address.startswith("ipc://") else None

    def cleanup(self) -> None:
        """Remove what binding left behind: the socket file, and our private directory."""
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)
        elif self.ipc_path is not None and os.path.exists(self.ipc_path):
            os.unlink(self.ipc_path)


def private_ipc_address() -> EngineAddress:
    directory = tempfile.mkdtemp(prefix="vllm-lite-")  # mode 0700: only this user reaches it
    return EngineAddress(f"ipc://{directory}/{IPC_SOCKET_NAME}", directory)


def normalize_address(address: str) -> str:
    """Check an address and fill in tcp's default host (127.0.0.1; `*` binds every interface)."""
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if not os.path.isabs(path):
            raise ValueError(f"engine address {address!r}: an ipc path must be absolute (ipc:///path)")
        return address
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://"):].rpartition(":")
        if not sep or not (port.isdigit() or port == "*"):
            raise ValueError(f"engine address {address!r}: expected tcp://host:port")
        return f"tcp://{host or '127.0.0.1'}:{'*' if port == '0' else port}"
    raise ValueError(f"engine address {address!r}: expected ipc:///path or tcp://host:port")


def check_ipc_free(address: str) -> None:
    """Binding an ipc path takes it over silently from an engine already serving there; refuse."""
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://"):]
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(path)
    except OSError:
        return  # a stale file from an engine that died: binding replaces it
    finally:
        probe.close()
    raise ValueError(f"engine address {address!r} is in use by another engine core")


# Messages a socket buffers per peer and direction. Finite, so a peer that stops reading cannot
# make us buffer without limit; large, so a burst (thousands of requests added before the first
# output is read) never reaches it. No deadlock: the engine core's socket thread always reads
# its clients, and sends to them without blocking (a full client is aborted, see core_io.py).
SOCKET_HWM = 10_000


def make_socket(ctx: zmq.Context, socket_type: int, *, bind: str | None = None,
                connect: str | None = None, identity: bytes | None = None,
                linger_ms: int = 0, hwm: int = SOCKET_HWM) -> zmq.Socket:
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, linger_ms)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if bind is not None:
        sock.bind(bind)
    if connect is not None:
        sock.connect(connect)
    return sock
