"""The sync/async bridge, written once: an event loop (uvloop) on a background thread.

The training loop is synchronous torch code on the main thread; the P2P streams, the exchange
handler and the DHT records are asyncio. `LoopThread.run` submits a coroutine from the main thread
and waits for its result; calling it from the loop's own thread raises instead of deadlocking.
`stop` cancels every task still on the loop and joins the thread, with a timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def torch_threads_here() -> None:
    """Give the calling thread torch's thread count (`torch.set_num_threads`), if torch is imported. OpenMP keeps the
    count per thread, and a thread that has not asked torch for it runs torch's ops on every core: a second
    `Peer.train()` (each on a thread of its own) took 45 inner steps a round against the first's 1,500, with the
    other core busy; a bare training loop on a fresh thread, 89 steps in 2 s against 2,375."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(torch.get_num_threads())


class LoopThread:
    def __init__(self, name: str = "murmur-loop") -> None:
        self._loop = uvloop.new_event_loop()
        # `asyncio.to_thread`'s threads (a donor's state packed, a download's unpacked) run torch's ops too
        self._loop.set_default_executor(
            concurrent.futures.ThreadPoolExecutor(thread_name_prefix=f"{name}-worker", initializer=torch_threads_here)
        )
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def _main(self) -> None:
        torch_threads_here()  # the exchange's codecs run here
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; returns a future the caller may wait on or cancel."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.submit called from its own loop thread: await the coroutine instead")
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the event-loop thread has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (cancelling it if `timeout` passes)."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"operation did not finish within {timeout} s") from None

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel and await every task on the loop, stop it, and join the thread."""
        if not self._thread.is_alive():
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=timeout) if tasks else None

        try:
            self.run(_cancel_all(), timeout=timeout)
        except (TimeoutError, RuntimeError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()
