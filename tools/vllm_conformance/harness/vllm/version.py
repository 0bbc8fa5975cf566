"""Stub of vllm.version: the version of the server under test (its /version must report it)."""

from vllm._served import server_version

__version__ = server_version()


def _prev_minor_version() -> str:
    major, minor = __version__.split(".")[:2]
    return f"{major}.{max(int(minor) - 1, 0)}"
