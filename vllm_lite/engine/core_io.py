"""The engine core's two I/O threads: they keep socket work and (de)serialization off the busy
loop, which only ever touches two `queue.Queue`s.

```
clients ── ROUTER ──▶ socket thread: decode ──▶ input_queue ──▶ busy loop
clients ◀── ROUTER ◀── socket thread ◀─inproc── output thread: encode ◀── output_queue ◀── busy loop
```

A ZMQ socket belongs to one thread, so the socket thread owns the ROUTER for both directions
and the output thread hands it encoded frames over an inproc pipe (zero-copy). Input items are
`(client identity, request type, decoded struct)`; output items `(client identity, output type,
struct)`, or None to stop both threads once everything before it is sent.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import zmq

from vllm_lite.wire import (
    REQUEST_STRUCTS,
    MsgpackDecoder,
    MsgpackEncoder,
    OutputType,
    RequestError,
    RequestIdsSender,
    RequestType,
    UtilityResult,
    peek_request_id,
)
from vllm_lite.engine.zmq_utils import check_ipc_free, make_socket

logger = logging.getLogger(__name__)

# Put on the input queue (never sent on the wire) when a client's socket is gone.
CLIENT_GONE = b"client-gone"
_PIPE_STOP = b"stop"
_FLUSH_MS = 500  # how long closing waits for queued outputs to leave


class EngineCoreIO:
    def __init__(self, address: str, input_queue: queue.Queue, output_queue: queue.Queue) -> None:
        self.input_queue = input_queue
        self.output_queue = output_queue
        check_ipc_free(address)
        self.ctx = zmq.Context()
        self.router = make_socket(self.ctx, zmq.ROUTER, linger_ms=_FLUSH_MS)
        # Unroutable sends raise instead of vanishing: that is how a departed client is noticed.
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.router.bind(address)
        except zmq.ZMQError as exc:
            self.ctx.destroy(linger=0)
            raise ValueError(f"engine address {address!r}: cannot bind ({exc})") from exc
        self.address = self.router.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp "*" port resolved
        pipe = f"inproc://engine-core-outputs-{id(self)}"
        self.pipe_in = make_socket(self.ctx, zmq.PULL, bind=pipe)
        self.pipe_out = make_socket(self.ctx, zmq.PUSH, connect=pipe)
        self.decoders = {tag: MsgpackDecoder(struct) for tag, struct in REQUEST_STRUCTS.items()}
        self.error_encoder = MsgpackEncoder()  # the socket thread's own (encoders are per thread)
        self.threads = [threading.Thread(target=self._socket_loop, name="engine-core-socket", daemon=True),
                        threading.Thread(target=self._output_loop, name="engine-core-output", daemon=True)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, stop both threads, release the sockets."""
        if self.threads[0].is_alive():
            self.output_queue.put(None)
            for thread in self.threads:
                thread.join(timeout_s)
        self.ctx.destroy(linger=_FLUSH_MS)

    # ---- socket thread ----
    def _socket_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.pipe_in, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self.pipe_in in ready:
                frames = self.pipe_in.recv_multipart(copy=False)
                if len(frames) == 1:
                    return  # _PIPE_STOP: everything queued before it has been sent
                self._send(frames)
            if self.router in ready:
                self._receive(self.router.recv_multipart(copy=False))

    def _send(self, frames: list[Any]) -> None:
        """Never blocks: a client that stopped reading (its high-water mark is full) or left is
        told to the busy loop, which aborts its requests (idempotent: a step or two of outputs
        may still fail after this one); other clients are not held up."""
        identity = frames[0].bytes if isinstance(frames[0], zmq.Frame) else frames[0]
        try:
            self.router.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.warning("engine core: client %s stopped reading; aborting its requests", identity.hex()[:8])
            self.input_queue.put((identity, CLIENT_GONE, None))
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                logger.error("engine core: dropped an output for client %s: %s", identity.hex()[:8], exc)
            self.input_queue.put((identity, CLIENT_GONE, None))

    def _receive(self, frames: list[zmq.Frame]) -> None:
        """Handle one client message; whatever goes wrong (a frame nested too deeply, garbage,
        a bug) is logged and costs only this message, never the socket thread."""
        try:
            self._decode(frames)
        except Exception:
            logger.exception("engine core: dropped a client message that could not be handled")

    def _decode(self, frames: list[zmq.Frame]) -> None:
        """Decode one client message. Anything malformed is logged and dropped; the client is
        told when the request id can still be read."""
        if len(frames) < 3:
            logger.warning("engine core: dropped a message of %d frame(s) (expected >= 3)", len(frames))
            return
        identity, tag = frames[0].bytes, frames[1].bytes
        decoder = self.decoders.get(tag)
        if decoder is None:
            logger.warning("engine core: dropped a message with unknown type %r", tag[:8])
            return
        try:
            message = decoder.decode(frames[2:])
        except Exception as exc:  # msgspec.DecodeError, RecursionError from deep nesting ...
            self._reject_malformed(identity, tag, frames[2], exc)
            return
        self.input_queue.put((identity, tag, message))

    def _reject_malformed(self, identity: bytes, tag: bytes, frame: zmq.Frame, exc: Exception) -> None:
        request_id = peek_request_id(frame) if tag == RequestType.ADD else None
        logger.warning("engine core: dropped a malformed message (type %r, request id %r): %s",
                       tag, request_id, exc)
        if request_id is not None:
            error = RequestError(request_id, f"malformed request: {exc}")
            self._send([identity, OutputType.ERROR, *self.error_encoder.encode(error)])

    # ---- output thread ----
    def _output_loop(self) -> None:
        encoder = MsgpackEncoder()
        ids_sender = RequestIdsSender()
        while True:
            item = self.output_queue.get()
            if item is None:
                self.pipe_out.send(_PIPE_STOP)
                return
            identity, tag, message = item
            if tag == OutputType.OUTPUTS:
                message = ids_sender.prepare(identity, message)
            try:
                frames = encoder.encode(message)
            except Exception as exc:  # an unencodable result costs only its own message
                logger.error("engine core: cannot encode a %s: %s", type(message).__name__, exc)
                if tag == OutputType.OUTPUTS:
                    ids_sender.forget(identity)  # its next message carries its ids (it never got these)
                if tag != OutputType.UTILITY_RESULT:
                    continue
                frames = encoder.encode(UtilityResult(message.call_id, error=f"unencodable result: {exc}"))
            self.pipe_out.send_multipart([identity, tag, *frames], copy=False)
