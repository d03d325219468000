"""The one OS thread a node runs torch on (loading, every step, embedding, the step channels), and its OpenMP
team between steps.

One thread: OpenMP (libgomp) gives every OS thread that enters a parallel region a team of its own. Two teams
in one process are more threads than a small host's cores, and libgomp then stops spinning between regions:
each of a step's hundreds of small parallel regions waits on a futex wake-up, and a step with two threads runs
no faster than with one. So torch never runs on the event loop's thread, nor on a second worker.

Between steps: after a parallel region libgomp's workers spin for a while (``GOMP_SPINCOUNT``, 100,000 pauses:
about 3 ms here) before they sleep, which bridges the short gaps between one step's regions. A single stream
through two daemons on one host computes on one, then the other; the first one's workers then spin on the cores
the second computes on, for most of an int8 half-model step. Where another daemon shares the host and the
thread has nothing queued, it *parks* its team (``meshnet_send_and_wait`` in ``gemv.c``): every thread of it
sleeps in poll(2) at once, and the next submission (a write to an eventfd) or a step channel's bytes wake them
together, the team kept. A lone daemon never parks: its gaps between steps are short and a spinning team takes
the next step without a wake-up. ``MESHNET_PARK=off`` never parks (to measure what parking does).

Step channels (:mod:`daemon.channel`): connections whose one-position steps this thread reads, computes and
answers itself, with no event loop between the socket and the layers. It waits on their sockets as on its
queue, and serves a channel when its next step has arrived, between the submissions it runs. A step's answer
is written by the same call that parks the team, once its workers sleep: the answer wakes the daemon that
computes next, which must not find this team still spinning on its cores (written first, the tail's workers
spun through the head's next step: a two-node int4 mesh ran at 0.74 of one node, against 0.81).

Measured on a 2-core host, a two-node mesh against one node with every layer, single stream: int8 0.87x with
parking, 0.70x without; float32 0.94x and 0.69x (BENCHMARKS.md, "Against llama.cpp").
"""

from __future__ import annotations

import logging
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future

from daemon.model import native

log = logging.getLogger(__name__)

PARK_ENV = "MESHNET_PARK"  # "off": the team spins and sleeps as libgomp decides
MAX_CHANNELS = 60  # a poll waits on the submissions' eventfd and these (gemv.c takes 64 descriptors)

# a channel's handler: reads the step whose bytes have arrived on the socket and answers the frame to write back
# (written by the thread as it goes to sleep, see _sleep), or None to close the channel
ChannelHandler = Callable[[socket.socket], bytes | None]


class TorchThread(Executor):
    """A one-thread executor whose thread parks its OpenMP team when idle and ``park_when_idle()`` says so, and
    serves the step channels handed to it (:meth:`serve`)."""

    def __init__(self, name: str = "torch") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self.park_when_idle: Callable[[], bool] = lambda: False
        self._parking = os.environ.get(PARK_ENV, "on").strip().lower() not in ("off", "0", "false", "no")
        self.parks = 0  # times the team was parked
        self._linger_until = 0.0  # monotonic: until then an idle thread sleeps alone, its team left spinning
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._channels: dict[int, tuple[socket.socket, ChannelHandler]] = {}  # by descriptor; this thread's own
        self._handed: list[tuple[socket.socket, ChannelHandler]] = []  # from other threads, taken on when awake
        self._answer: tuple[int, bytes] | None = None  # a channel's step answer to write, and on which channel
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: Future = Future()
            self._queue.put((future, fn, args, kwargs))
        self._wake()  # after the put: a thread about to sleep finds the eventfd readable
        return future

    def serve(self, sock: socket.socket, handler: ChannelHandler) -> bool:
        """Serve a step channel on this thread from now on: ``handler(sock)`` each time bytes arrive, until it
        answers None or the peer hangs up (the socket is then closed). False, and the socket closed, when the
        thread is shut down or serves as many channels as it can."""
        with self._lock:
            if self._closed or len(self._channels) + len(self._handed) >= MAX_CHANNELS:
                sock.close()
                return False
            self._handed.append((sock, handler))
        self._wake()
        return True

    def wait_answer(self, sock: socket.socket, data: bytes, timeout: float) -> bool:
        """On this thread, in the work it runs (a walk along step channels): write ``data`` on ``sock`` with the
        team asleep (where it parks), and sleep until the answer's bytes arrive; False when ``timeout`` seconds
        pass first, ``ConnectionError`` when the write fails. Steps that arrive on this thread's own channels
        meanwhile are served: two heads walking through each other's layers must not wait on each other."""
        deadline = time.monotonic() + timeout
        lib = native.library()
        fd = sock.fileno()
        while True:
            self._take_handed()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            fds = [fd, *self._channels]
            if lib is None:
                if data:
                    sock.sendall(data)
                poll_readable(fds, left)
            elif lib.wait_readable(fds, team=self._parking and self.park_when_idle(), timeout=left,
                                   send_fd=fd if data else -1, data=data) == -2:
                raise ConnectionError("the node stopped taking steps")
            data = b""
            ready = poll_readable(fds, 0)
            if fd in ready:
                return True
            self._serve_ready(ready)
            self._send_answer()

    def linger(self, seconds: float) -> None:
        """On this thread, from the work it runs: the next submission is on its way (the head's generation loop
        sends its next step as soon as it has this one's token). For up to ``seconds`` the thread then waits
        for it alone, its team's workers left spinning as libgomp has them do after a region, rather than
        parking them all: the next step starts without waking the team (on a VM, a core gone idle is slow
        and uneven to wake)."""
        self._linger_until = time.monotonic() + seconds

    @property
    def channels(self) -> int:
        return len(self._channels) + len(self._handed)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                if cancel_futures:
                    self._cancel_queued()
                self._queue.put(None)
        self._wake()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _cancel_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].cancel()

    def _wake(self) -> None:
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:  # closed: the thread has ended
            pass

    def _work(self) -> None:
        try:
            while True:
                try:  # what wakes the thread is read before the queue is looked at: a later put wakes it again
                    os.eventfd_read(self._wake_fd)
                except BlockingIOError:
                    pass
                self._take_handed()
                ran = False
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    pass
                else:
                    if item is None:
                        return
                    self._send_answer()  # an answer waits for nothing else
                    self._run(item)
                    ran = True
                if self._channels and self._serve_ready(poll_readable(self._channels, 0)):
                    continue
                if not ran:
                    self._sleep()
        finally:
            self._send_answer()
            for sock, _ in [*self._channels.values(), *self._handed]:
                sock.close()
            self._channels.clear()
            os.close(self._wake_fd)

    @staticmethod
    def _run(item) -> None:
        future, fn, args, kwargs = item
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, as ThreadPoolExecutor does
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _take_handed(self) -> None:
        if self._handed:
            with self._lock:
                handed, self._handed = self._handed, []
            for sock, handler in handed:
                self._channels[sock.fileno()] = sock, handler


    def _serve_ready(self, ready: list[int]) -> bool:
        for fd in ready:
            self._send_answer()
            if fd not in self._channels:  # closed as the last answer failed to go out (or not a channel)
                continue
            sock, handler = self._channels[fd]
            try:
                answer = handler(sock)
            except Exception:  # noqa: BLE001 - one channel's failure closes it, never the thread
                log.exception("step channel from %s failed; closed", _peer(sock))
                answer = None
            if answer is None:
                self._close(fd)
            else:
                self._answer = fd, answer
        return bool(ready)

    def _send_answer(self) -> None:
        """Write the last step's answer now (other work comes first; or a sleep without the native library)."""
        if self._answer is None:
            return
        (fd, data), self._answer = self._answer, None
        try:
            self._channels[fd][0].sendall(data)
        except OSError:
            self._close(fd)

    def _close(self, fd: int) -> None:
        closing = self._channels.pop(fd, None)
        if closing is not None:
            closing[0].close()

    def _sleep(self) -> None:
        """Until a submission or a channel's bytes: with the team asleep too where another daemon shares the
        cores, after the last step's answer is written (the write wakes the daemon that computes next, which
        must find this team asleep already). A wake-up may come late (a submission's wake can follow the thread
        through that very work): the loop then finds nothing and sleeps again."""
        lib = native.library()
        if lib is None:
            self._send_answer()
            poll_readable([self._wake_fd, *self._channels], None)
            return
        (send_fd, data), self._answer = self._answer or (-1, b""), None
        fds = [self._wake_fd, *self._channels]
        team = self._parking and self.park_when_idle()
        if team and send_fd < 0 and self._linger_until > time.monotonic():
            if lib.wait_readable(fds, team=False, timeout=self._linger_until - time.monotonic()) > 0:
                return
        self.parks += team
        if lib.wait_readable(fds, team=team, send_fd=send_fd, data=data) == -2:
            self._close(send_fd)


def poll_readable(fds, timeout: float | None) -> list[int]:
    """Which of ``fds`` are readable (or hung up), waiting up to ``timeout`` seconds (None: until one is)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(None if timeout is None else max(0, int(timeout * 1000)))]


def _peer(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "a closed peer"
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else "a local peer"
