"""A rank's watch on the step broadcast (`DisconnectWatchdog`) and its last message: the rank
exits when the broadcast drops (unless a Shutdown came), and a failing rank's error goes out
before the process ends, without libzmq aborting it (a socket closed by one thread while another
waited on it: "Assertion failed: pfd.revents & POLLIN", the rank gone with code -6 and its error
lost). Each case runs in a child process: what is checked is how that process ends."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SETUP = """
import tempfile, threading, time, zmq
from vllm_lite.executor.messages import MessageCodec
from vllm_lite.executor import worker_proc

def broadcast(tmp):
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"ipc://{tmp}/steps")
    sub = ctx.socket(zmq.SUB)
    monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    return ctx, pub, sub, monitor
"""


def run_child(body: str) -> subprocess.CompletedProcess:
    code = SETUP + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_failing_rank_s_last_message_leaves_and_the_process_lives_to_exit() -> None:
    """A rank's sockets as `WorkerProc` sets them up (its watchdog waiting on the broadcast), then
    `_send_error` as a failing rank runs it, 40 times: the error arrives every time and the
    process is never aborted by libzmq on the way out."""
    result = run_child("""
        for i in range(40):
            with tempfile.TemporaryDirectory() as tmp:
                steps_ctx = zmq.Context()
                pub = steps_ctx.socket(zmq.PUB)
                pub.bind(f"ipc://{tmp}/steps")
                collector = steps_ctx.socket(zmq.PULL)
                collector.bind(f"ipc://{tmp}/replies")
                proc = worker_proc.WorkerProc(None, f"ipc://{tmp}/steps", f"ipc://{tmp}/replies",
                                              threading.Event(), rank=1)
                time.sleep(0.01)
                proc._send_error(f"rank 1: boom {i}")
                assert collector.poll(10_000), "the error never arrived"
                reply = MessageCodec().decode_reply(collector.recv_multipart())
                assert reply.rank == 1 and reply.error == f"rank 1: boom {i}", reply
                steps_ctx.destroy(linger=0)
        print("all sent")
    """)
    assert result.returncode == 0 and "all sent" in result.stdout, result.stderr[-2000:]
    assert "Assertion failed" not in result.stderr


def test_the_broadcast_dropping_ends_the_rank_after_the_grace() -> None:
    result = run_child("""
        with tempfile.TemporaryDirectory() as tmp:
            ctx, pub, sub, monitor = broadcast(tmp)
            worker_proc.DisconnectWatchdog(monitor, threading.Event(), grace=0.2)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"ipc://{tmp}/steps")
            time.sleep(0.3)
            pub.close()  # the engine core went away
            time.sleep(30)
        print("still running")
    """)
    assert result.returncode == 1 and "still running" not in result.stdout, result.stderr[-2000:]


def test_a_shutdown_within_the_grace_lets_the_rank_finish_on_its_own() -> None:
    result = run_child("""
        with tempfile.TemporaryDirectory() as tmp:
            ctx, pub, sub, monitor = broadcast(tmp)
            stopping = threading.Event()
            watchdog = worker_proc.DisconnectWatchdog(monitor, stopping, grace=5.0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"ipc://{tmp}/steps")
            time.sleep(0.3)
            pub.close()
            stopping.set()  # the Shutdown was read: the main thread is on its way out
            time.sleep(1.0)
        print("finished")
    """)
    assert result.returncode == 0 and "finished" in result.stdout, result.stderr[-2000:]
