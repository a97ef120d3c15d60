"""Where an environment's methods run during :func:`~strop.agents.rollout.run_episodes`.

:data:`LOOP` is one event loop in a daemon thread, (re)started when needed, shared by every
batch of episodes of the process; :func:`call_method` runs an environment method on it: an
``async def`` one awaited on the loop, a plain one in a daemon thread of its own (Python
cannot stop a thread: a runaway call keeps it), so that a slow ``step`` never holds up the
others. The loop's default executor (``asyncio.to_thread``, where tool calls run) has
:meth:`SharedLoop.size_executor`'s threads: one per episode of the batch, since tool calls
mostly wait on a child process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import threading
from collections.abc import Callable
from typing import Any

from strop.rewards.calling import one_line


async def call_method(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``method(*args, **kwargs)``: awaited on the loop when ``async def``, else in a daemon
    thread (Python cannot stop a thread: a runaway call keeps it)."""
    if inspect.iscoroutinefunction(method):
        try:
            return await method(*args, **kwargs)
        except SystemExit as exc:  # would stop the loop's thread
            raise RuntimeError(one_line(exc)) from None
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def work() -> None:
        try:
            result: Any = method(*args, **kwargs)
            ok = True
        except BaseException as exc:  # SystemExit from an environment is contained too
            result, ok = exc, False

        def settle() -> None:
            if not future.done():
                if ok:
                    future.set_result(result)
                else:
                    exc = (
                        result if isinstance(result, Exception) else RuntimeError(one_line(result))
                    )
                    future.set_exception(exc)

        loop.call_soon_threadsafe(settle)

    threading.Thread(target=work, name="strop-env-step", daemon=True).start()
    result = await future
    if inspect.isawaitable(result):  # a plain method returning a coroutine
        result = await result
    return result


class SharedLoop:
    """An event loop in a daemon thread for environment calls, (re)started when needed,
    whose default executor (``asyncio.to_thread``) has :meth:`size_executor`'s threads."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._executor, self._workers = cf.ThreadPoolExecutor(1), 1

    def size_executor(self, workers: int) -> None:
        """``workers`` threads for the loop's blocking calls (not asyncio's default, ``min(32,
        cores + 4)``: tool calls mostly wait); calls still running keep the old pool's."""
        with self._lock:
            if workers != self._workers:
                self._executor.shutdown(wait=False)
                self._executor = cf.ThreadPoolExecutor(workers, thread_name_prefix="strop-tool")
                self._workers = workers
                self._loop.set_default_executor(self._executor)

    def submit(self, coroutine: Any) -> cf.Future:
        """Run ``coroutine`` on the loop (started first if it is not running)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._loop = asyncio.new_event_loop()
                self._loop.set_default_executor(self._executor)
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name="strop-env-loop", daemon=True
                )
                self._thread.start()
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)


LOOP = SharedLoop()
"""The process's one loop for environment calls, shared by every batch of episodes."""
