"""Tensor parallelism in real gloo processes (no mocks): tp = 2 alone and tp = 2 x pp = 2 on tiny
GPT-2 (tied wte / lm_head), Llama (grouped-query attention) and BERT, sharded as
``find_tensor_parallel`` finds in each profile (BERT: sibling-module pairs), against the plain
model."""

import json
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("world", "sequence_parallel"), [(2, False), (4, False), (2, True),
                                                         (4, True)],
                         ids=["tp2", "tp2xpp2", "tp2-sp", "tp2xpp2-sp"])
def test_loss_every_gradient_state_and_norm_match_the_plain_model(
        world: int, sequence_parallel: bool) -> None:
    # one spawn runs the three models; each rank writes the checks it saw fail
    with tempfile.TemporaryDirectory() as out:
        script = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(ROOT)!r})
            import torch.multiprocessing as mp
            from tests.distributed.tp_worker import tp_numerics
            if __name__ == "__main__":
                mp.spawn(tp_numerics, nprocs={world}, join=True,
                         args=({world}, {_free_port()}, {out!r}, {sequence_parallel}))
        """)
        proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                              text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        problems = {r: json.loads((Path(out) / f"{r}.json").read_text()) for r in range(world)}
    assert problems == {r: [] for r in range(world)}
