"""The one thread that runs an engine's computation: model loading, warm-up and steps.

Why one thread: the OpenMP runtime torch and the native kernels share (libgomp)
keeps a separate worker pool for every thread that opens a parallel region. A
server that loads the model on its main thread and steps the engine on another
has two pools, more OpenMP threads than cores, and libgomp then throttles its
spin-waits, so workers sleep and wake at every barrier. Measured on 2 cores
(bf16 SmolLM2, batch-1 decode): 94 tok/s with everything on one thread, 70 tok/s
with loading on the main thread and steps on an engine thread.

:class:`ComputeThread` is a :class:`concurrent.futures.Executor` with exactly one
daemon thread: submit the load, the engine construction and the engine loop (or,
with async scheduling, the forwards) to it, in that order.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")


def run_on(executor: Executor | None, fn: Callable[..., T], /, *args: Any) -> T:
    """``fn(*args)`` on ``executor``'s thread, waiting for it (here when ``executor`` is None: the engine's
    forwards run where its steps do)."""
    return fn(*args) if executor is None else executor.submit(fn, *args).result()


class ComputeThread(Executor):
    """A single long-lived worker thread; tasks run one at a time in submission order."""

    def __init__(self, name: str = "xllm-compute") -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._lock:
            if self._closed:
                raise RuntimeError("ComputeThread is shut down")
            future: Future[T] = Future()
            self._tasks.put((future, fn, args, kwargs))
        return future

    def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the compute thread and return its result (re-raising its exception)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop after the tasks already submitted (dropping them with ``cancel_futures``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        future, *_ = self._tasks.get_nowait()
                    except queue.Empty:
                        break
                    future.cancel()
            self._tasks.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _work(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the submitter
                future.set_exception(exc)
