"""The rendezvous of one engine: a torch.distributed TCPStore hosted by the engine core.

Every rank joins the process group through it (torch.distributed's own TCP rendezvous) and reads
from it what the engine core published there: its configuration (for ranks on other nodes) and
the addresses of the step broadcast and of the reply channel. Without a fixed master_port the
store listens on port 0, so the OS picks a free port and two engines never clash.
"""

from __future__ import annotations

import datetime
import socket
import time

import msgspec
import torch.distributed as dist

from vllm_lite.config import ParallelConfig, VllmConfig

STORE_TIMEOUT = datetime.timedelta(seconds=300)  # how long a rank waits for the engine core
_CONFIG_KEY = "vllm_lite/config"
_ENDPOINTS_KEY = "vllm_lite/endpoints"


class Endpoints(msgspec.Struct, array_like=True, gc=False):
    steps: str  # the step broadcast (ZMQ XPUB of the engine core): every rank subscribes
    replies: str  # the engine core's ZMQ PULL: rank 0 pushes each step's output


def host_store(parallel: ParallelConfig) -> dist.TCPStore:
    """The engine core's store, on master_port or on a free port (read it back from `.port`)."""
    return dist.TCPStore(parallel.master_addr, parallel.master_port or 0, None, True,
                         timeout=STORE_TIMEOUT, wait_for_workers=False)


def join_store(master_addr: str, master_port: int) -> dist.TCPStore:
    """Connect to an engine core's store, retrying until it is up or STORE_TIMEOUT passes."""
    return dist.TCPStore(master_addr, master_port, None, False, timeout=STORE_TIMEOUT)


def wait_for_store(master_addr: str, master_port: int) -> None:
    """Wait quietly until the store accepts connections (a node started before node 0): torch's
    own retries log a C++ stack trace for every attempt."""
    deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
    while True:
        try:
            socket.create_connection((master_addr, master_port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no rendezvous at {master_addr}:{master_port} within "
                                   f"{STORE_TIMEOUT.total_seconds():.0f} s: is node 0 running?") from None
            time.sleep(0.2)


def publish(store: dist.Store, vllm_config: VllmConfig, endpoints: Endpoints) -> None:
    store.set(_CONFIG_KEY, msgspec.msgpack.encode(vllm_config))
    store.set(_ENDPOINTS_KEY, msgspec.msgpack.encode(endpoints))


def read_config(store: dist.Store) -> VllmConfig:
    """Node 0's engine configuration (waits until it is published)."""
    return msgspec.msgpack.decode(store.get(_CONFIG_KEY), type=VllmConfig)


def read_endpoints(store: dist.Store) -> Endpoints:
    return msgspec.msgpack.decode(store.get(_ENDPOINTS_KEY), type=Endpoints)
