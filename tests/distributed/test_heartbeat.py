"""The heartbeat thread beside a multi-process pipeline, on a real TCPStore."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_process_that_never_stops_its_heartbeat_still_exits_cleanly() -> None:
    # A daemon thread inside a store call when Python finalizes aborts the process
    # ("terminate called without an active exception"). Beating without pause keeps the
    # threads inside store calls; before the heartbeat stopped itself at exit this script
    # aborted in 30 runs of 30.
    script = textwrap.dedent(f"""
        import datetime, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import torch.distributed as dist
        from autopart.runtime.distributed.heartbeat import Heartbeat
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))
        beats = [Heartbeat(store, 0, 1, period_s=0.0) for _ in range(4)]
        time.sleep(0.2)
        stopped = Heartbeat(store, 0, 1, period_s=0.0)
        stopped.stop()
        assert not stopped._thread.is_alive()
        print("done")
    """)
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == "done"


def test_a_rank_waiting_in_a_collective_is_not_hung_and_one_told_to_exit_still_is() -> None:
    # rank 1 computes in 0F1 for 10 s (hung); rank 2 waits in a collective inside 0F1 as long
    # (it waits for rank 1: not hung); rank 3 was told to exit and has (its stamp is stale,
    # yet it hung rather than died); rank 4 stopped beating (dead)
    import datetime
    import json
    import time

    import torch.distributed as dist

    from autopart.runtime.distributed.heartbeat import Heartbeat

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))
    now = time.time()
    states = {1: (now, False), 2: (now, True), 3: (now - 1e4, False), 4: (now - 1e4, False)}
    for r, (stamp, waiting) in states.items():
        store.set(f"autopart/state/{r}", json.dumps(
            {"stamp": stamp, "action": "0F1", "since": now - 10, "waiting": waiting}))
    store.set("autopart/exited/3", "it hangs in action 0F1")
    # a long period: stamps older than 4 periods are stale, so "now" stays fresh however slow
    beat = Heartbeat(store, 0, 5, period_s=60.0)
    try:
        dead, hung = beat.diagnose(hung_after_s=4.0, within_s=0.0)
    finally:
        beat.stop()
    assert dead == [4]
    assert sorted(hung) == [1, 3] and {a for a, _ in hung.values()} == {"0F1"}


def test_in_collective_reads_where_a_blocked_thread_is() -> None:
    import sys
    import threading
    import time

    from autopart.runtime.distributed.heartbeat import in_collective

    class Op:  # what torch._ops' __call__ runs as ``self``: an op named by its str
        def __init__(self, name: str) -> None:
            self.name = name

        def __str__(self) -> str:
            return self.name

    def blocked_in(module: str, op: str = "") -> bool:
        lock = threading.Lock()
        lock.acquire()
        scope = {"__name__": module, "lock": lock}
        # a function of ``module`` blocked in C code (as a gloo wait blocks), seen from outside
        exec("def wait(self):\n    lock.acquire()\n", scope)
        thread = threading.Thread(target=scope["wait"], args=(Op(op),))
        thread.start()
        try:
            while True:
                frame = sys._current_frames().get(thread.ident)
                if frame is not None and frame.f_globals.get("__name__") == module:
                    return in_collective(frame)
                time.sleep(0.01)
        finally:
            lock.release()
            thread.join()

    assert blocked_in("torch.distributed.distributed_c10d")  # a c10d call's wait
    assert blocked_in("torch.distributed.fsdp._fully_shard._fsdp_collectives")
    assert not blocked_in("torch.distributed.pipelining.stage")  # the stage computing
    assert not blocked_in("tests.user_code")  # a stage stalled in the user's code
    # torch.ops calls: a functional collective's wait (the tp ops) waits; an aten op computes
    assert blocked_in("torch._ops", "_c10d_functional.wait_tensor.default")
    assert not blocked_in("torch._ops", "aten.mm.default")
    assert not in_collective(None)
