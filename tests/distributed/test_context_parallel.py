"""Context parallelism in real gloo processes (no mocks): tiny Llama (grouped-query attention,
causal), GPT-2 (causal) and BERT (attention over the whole sequence) with each sequence split
over cp ranks (alone at cp 2 and 4, with pp 2, with dp 2 and ZeRO-1, with tp 2, and through
``autopart.compile(..., cp=2)``), against the plain model on whole sequences: the global
loss on every rank and every gradient (float32, rtol 1e-5, atol 4e-5)."""

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


@pytest.mark.parametrize(("world", "pp", "cp", "names", "seq", "zero", "compiled", "tp"), [
    (2, 1, 2, ["llama", "gpt2", "bert"], 64, 0, True, 1),
    (4, 1, 4, ["llama"], 4096, 0, False, 1),
    (4, 2, 2, ["llama", "bert"], 64, 0, False, 1),
    (4, 1, 2, ["llama", "gpt2"], 64, 1, False, 1),
    (4, 1, 2, ["llama", "bert"], 64, 0, False, 2),
], ids=["cp2", "cp4-seq4096", "pp2xcp2", "dp2xcp2-zero1", "tp2xcp2"])
def test_loss_and_every_gradient_match_the_plain_model(
        world: int, pp: int, cp: int, names: list[str], seq: int, zero: int,
        compiled: bool, tp: int) -> None:
    with tempfile.TemporaryDirectory() as out:
        script = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(ROOT)!r})
            import torch.multiprocessing as mp
            from tests.distributed.cp_worker import cp_numerics
            if __name__ == "__main__":
                mp.spawn(cp_numerics, nprocs={world}, join=True,
                         args=({world}, {_free_port()}, {out!r}, {pp}, {cp}, {names!r}, {seq},
                               {zero}, {compiled}, {tp}))
        """)
        proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                              text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        problems = {r: json.loads((Path(out) / f"{r}.json").read_text()) for r in range(world)}
    assert problems == {r: [] for r in range(world)}
