"""lifecycle.py: the one place child processes are started, watched, stopped and reaped."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

import pytest

from vllm_lite.lifecycle import START_METHOD_ENV, DeathWatch, ProcessResources, spawn, stop_processes


def _sleep_forever() -> None:
    while True:
        time.sleep(1)


def _ignore_sigterm(ready: Connection) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.send(True)
    _sleep_forever()


def _is_zombie_or_gone(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0]  # the state letter
    except FileNotFoundError:
        return "gone"


def test_stop_processes_reaps_a_child_that_was_killed_already() -> None:
    proc = spawn(_sleep_forever, (), name="lifecycle-test")
    os.kill(proc.pid, signal.SIGKILL)
    time.sleep(0.2)  # dead but not waited for: a zombie until someone reaps it
    stop_processes([proc])
    assert _is_zombie_or_gone(proc.pid) == "gone"
    assert proc.exitcode == -signal.SIGKILL


def test_stop_processes_escalates_to_sigkill() -> None:
    ready, ready_child = multiprocessing.Pipe(duplex=False)
    proc = spawn(_ignore_sigterm, (ready_child,), name="lifecycle-test")
    assert ready.poll(60)  # its handler is installed (a sleep was too short on a loaded machine)
    stop_processes([proc], grace_s=0.0, terminate_timeout_s=0.5)
    assert proc.exitcode == -signal.SIGKILL and _is_zombie_or_gone(proc.pid) == "gone"


def test_death_watch_reports_a_death_and_stays_quiet_after_stop() -> None:
    reported: list[list[int]] = []
    done = threading.Event()
    proc = spawn(_sleep_forever, (), name="lifecycle-test")
    watch = DeathWatch([proc], lambda dead: (reported.append([p.pid for p in dead]), done.set()), name="w")
    proc.kill()
    assert done.wait(10)
    assert reported == [[proc.pid]] and proc.exitcode == -signal.SIGKILL
    watch.stop()

    quiet = spawn(_sleep_forever, (), name="lifecycle-test")
    resources = ProcessResources(procs=[quiet])
    resources.watch = DeathWatch([quiet], lambda dead: reported.append([-1]), name="w")
    resources.release()
    resources.release()  # idempotent
    time.sleep(0.1)
    assert reported == [[proc.pid]] and _is_zombie_or_gone(quiet.pid) == "gone"


# ---- engine-core and rank processes: forked by a fork server that imported torch ----

def _report(conn: Connection) -> None:
    conn.send((os.getppid(), "torch" in sys.modules, os.environ.get("LIFECYCLE_PROBE")))
    conn.close()


def _start_and_report(imports_torch: bool = True) -> tuple[int, bool, str | None]:
    """(the child's parent pid, whether torch was imported before its target ran, its
    LIFECYCLE_PROBE variable)."""
    reader, writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
    proc = spawn(_report, (writer,), name="lifecycle-test", imports_torch=imports_torch)
    writer.close()
    try:
        assert reader.poll(60), "the child did not report"
        return reader.recv()
    finally:
        reader.close()
        stop_processes([proc], grace_s=10)


def test_torch_children_fork_from_one_server_that_imported_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    server, had_torch, _ = _start_and_report()
    assert server != os.getpid() and had_torch
    assert _start_and_report()[0] == server
    plain_parent, plain_had_torch, _ = _start_and_report(imports_torch=False)
    assert plain_parent == os.getpid() and not plain_had_torch


def test_the_child_has_the_environment_of_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked child takes its parent's environment of the moment; a change to what torch and
    its libraries read as they load (LOAD_TIME_ENV) has it spawned instead."""
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    server = _start_and_report()[0]
    monkeypatch.setenv("LIFECYCLE_PROBE", "changed")
    assert _start_and_report() == (server, True, "changed")
    monkeypatch.setenv("GOMP_SPINCOUNT", str(int(os.environ.get("GOMP_SPINCOUNT", "0")) + 1))
    parent, _, probe = _start_and_report()
    assert parent == os.getpid() and probe == "changed"


def test_vllms_start_method_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert _start_and_report()[0] == os.getpid()
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match="VLLM_WORKER_MULTIPROC_METHOD='fork' is not one of forkserver, spawn"):
        _start_and_report()
