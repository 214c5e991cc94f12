"""The host thread that steps an offloaded optimizer's params while the caller's thread goes on
(queueing backward's or the next forward's work): fusedamp's CPU ops release the GIL."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class Worker:
    """One host thread running tasks in order, started at the first task. A task's error is
    raised by the next drain(), on the caller's thread.

    >>> worker = Worker()
    >>> worker.submit(lambda: print("stepped"))
    >>> worker.drain()  # waits for every task submitted so far
    """

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, task: Callable[[], None]) -> None:
        with self._idle:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fusedamp-offload", daemon=True)
            self._thread.start()
        self._tasks.put(task)

    def drain(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"fusedamp offload: a step on the worker thread failed: {error}") from error

    def close(self) -> None:
        if self._thread is not None:
            self._tasks.put(None)

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except BaseException as error:  # raised again by drain(), on the caller's thread
                with self._idle:
                    self._error = self._error or error
            finally:
                task = None
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
