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
        from autopart.runtime.heartbeat import Heartbeat
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
