"""lifecycle.py: the one place child processes are spawned, watched, stopped and reaped."""

from __future__ import annotations

import os
import signal
import threading
import time

from vllm_lite.lifecycle import DeathWatch, ProcessResources, spawn, stop_processes


def _sleep_forever() -> None:
    while True:
        time.sleep(1)


def _ignore_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
    proc = spawn(_ignore_sigterm, (), name="lifecycle-test")
    time.sleep(0.5)  # let it install its handler
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
