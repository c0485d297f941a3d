"""Issuing threads: each rank's actions issued from a worker thread of its own (torchgpipe's scheme)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from autopart.core.errors import PlanError
from autopart.core.schedule import Action, Schedule, execution_order

__all__ = ["DependencyBoard", "IssueThreads", "check_issue_threads", "posted_key", "thread_orders",
           "waited_keys"]

# ("F", s, i): stage s's outputs of microbatch i exist; ("G", s, i): stage s sent the input
# gradients of microbatch i to stage s - 1 (by its B or its I)
Key = tuple[str, int, int]


def waited_keys(action: Action, num_stages: int, present: frozenset[Action]) -> list[Key]:
    """What ``action`` needs from another stage before it can be issued.

    A stage's ``F`` waits for the previous stage's ``F`` of the microbatch; its ``B`` or ``I``
    for the next stage's input gradients (from that stage's ``B`` or ``I``, whichever the
    schedule runs). Its own ``F`` before its backward and ``I`` before ``W`` are on the same
    stage, hence the same rank and thread, and ordered by the schedule.

    Args:
        action: the action about to be issued.
        num_stages: total stages S.
        present: every action of the schedule (a forward-only schedule has no backward to
            wait for).
    """
    s, i = action.stage_index, action.mb_index
    if action.kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    if action.kind in "BI" and s < num_stages - 1:
        if Action(s + 1, "B", i) in present or Action(s + 1, "I", i) in present:
            return [("G", s + 1, i)]
    return []


def posted_key(action: Action) -> Key | None:
    """What ``action`` makes available to other stages once it ran (None: nothing)."""
    if action.kind == "F":
        return ("F", action.stage_index, action.mb_index)
    if action.kind in "BI":
        return ("G", action.stage_index, action.mb_index)
    return None


def check_issue_threads(issue_threads: int | None) -> None:
    """Refuse an issuing-thread count below 1.

    Raises:
        PlanError: ``issue_threads`` below 1 (None, one thread per rank, is valid).
    """
    if issue_threads is not None and issue_threads < 1:
        raise PlanError(f"issue_threads={issue_threads} must be >= 1, or None for one thread "
                        "per rank")


def thread_orders(schedule: Schedule, num_stages: int,
                  issue_threads: int | None) -> list[list[Action]]:
    """Per issuing thread, the actions it issues, in order.

    Rank ``r`` goes to thread ``r % issue_threads`` (``issue_threads=None``: one thread per
    rank), as :class:`autopart.core.runtime_model.RuntimeDescription` prices it. Each thread
    follows :func:`autopart.core.schedule.execution_order` restricted to its ranks: that keeps
    every rank's own order, and a thread only ever waits for an action earlier in that one
    global order, so no set of threads can wait on each other in a cycle.

    Raises:
        PlanError: the schedule deadlocks (from ``execution_order``), or ``issue_threads``
            below 1.
    """
    check_issue_threads(issue_threads)
    order = execution_order(schedule, num_stages)
    rank_of = {a: r for r, acts in enumerate(schedule) for a in acts}
    k = len(schedule) if issue_threads is None else min(issue_threads, len(schedule))
    per_thread: list[list[Action]] = [[] for _ in range(max(k, 1))]
    for a in order:
        per_thread[rank_of[a] % k].append(a)
    return [acts for acts in per_thread if acts]


class _Abandoned(Exception):
    """Raised in a waiting worker when another worker failed: the step is over."""


class DependencyBoard:
    """Which stages' results exist yet; workers wait here for what another stage sends.

    One condition variable guards the posted keys. A worker that raises calls :meth:`fail`,
    which wakes every waiter so that it stops (no thread is left waiting for a value that
    will never come), and the step re-raises the first failure on the caller's thread.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._posted: set[Key] = set()
        self.failure: BaseException | None = None

    def post(self, key: Key) -> None:
        """Mark ``key`` available and wake the waiters."""
        with self._cond:
            self._posted.add(key)
            self._cond.notify_all()

    def wait(self, keys: Sequence[Key]) -> None:
        """Block until every key is posted.

        Raises:
            _Abandoned: another worker failed while this one waited.
        """
        if not keys:
            return
        with self._cond:
            while True:
                if self.failure is not None:
                    raise _Abandoned
                if all(k in self._posted for k in keys):
                    return
                self._cond.wait()

    def fail(self, exc: BaseException) -> None:
        """Record the first failure and wake every waiter."""
        with self._cond:
            if self.failure is None:
                self.failure = exc
            self._cond.notify_all()


class _CallerContext:
    """The thread-local torch state a worker takes over from the caller: grad mode and
    autocast (per device type; torch keeps both per thread, as ``nn.DataParallel``'s
    ``parallel_apply`` does for its workers)."""

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.cache = torch.is_autocast_cache_enabled()
        self.autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
                         if torch.is_autocast_enabled(d)]

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype,
                                                   cache_enabled=self.cache))
            yield


class IssueThreads:
    """Persistent worker threads that issue a step's actions, one list of actions each.

    The threads live as long as this object (a ``ThreadPoolExecutor``), so per-thread
    library state (OpenMP teams, cuBLAS handles and their workspaces per stream) is made
    once, not every step.

    Args:
        intra_op_threads: ``torch.set_num_threads`` for each worker while it runs (default
            None: ``max(1, torch.get_num_threads() // workers)``, so k workers of CPU stages
            share the cores instead of each starting a team of every core); the caller's
            setting is restored after the step.
    """

    def __init__(self, intra_op_threads: int | None = None) -> None:
        if intra_op_threads is not None and intra_op_threads < 1:
            raise PlanError(f"intra_op_threads={intra_op_threads} must be >= 1 (or None)")
        self.intra_op_threads = intra_op_threads
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0
        self._hook_lock = threading.Lock()

    def run(self, orders: Sequence[Sequence[Action]], num_stages: int,
            present: frozenset[Action], issue: Callable[[Action], None],
            after: Callable[[Action], None] | None = None) -> None:
        """Issue ``orders[t]`` on worker ``t``, each action once its inputs were posted.

        Args:
            orders: per worker, its actions in order (:func:`thread_orders`).
            num_stages: total stages S.
            present: every action of the schedule.
            issue: runs one action (on the worker's thread).
            after: called after each action, serialised under a lock (hooks that read
                the step's shared counters).

        Raises:
            BaseException: the first exception any worker raised, re-raised here after every
                worker stopped.
        """
        caller_threads = torch.get_num_threads()
        per_worker = self.intra_op_threads or max(1, caller_threads // len(orders))
        context = _CallerContext()
        board = DependencyBoard()

        def work(actions: Sequence[Action]) -> None:
            try:
                torch.set_num_threads(per_worker)
                with context.applied():
                    for a in actions:
                        board.wait(waited_keys(a, num_stages, present))
                        issue(a)
                        key = posted_key(a)
                        if key is not None:
                            board.post(key)
                        if after is not None:
                            with self._hook_lock:
                                after(a)
            except _Abandoned:
                return
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                board.fail(exc)

        pool = self._workers(len(orders))
        try:
            wait([pool.submit(work, acts) for acts in orders])
        finally:
            torch.set_num_threads(caller_threads)
        if board.failure is not None:
            raise board.failure

    def _workers(self, n: int) -> ThreadPoolExecutor:
        if self._pool is None or self._size != n:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="autopart-issue")
            self._size = n
        return self._pool

    def close(self) -> None:
        """Stop the worker threads (they also stop when the process exits)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
