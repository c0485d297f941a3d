"""Expert parallelism in real gloo processes (no mocks): tiny Mixtral, Qwen3-MoE and
DeepSeek-V3 (shared expert, grouped routing) with their experts split over ep of the dp
replicas (ep = dp, ep < dp with expert-data-parallel replicas, ep x pp), against the plain
model on the global batch: the loss on every rank, every gradient, the whole state dict,
reloading it and the gradient norm; with ZeRO 1 and 3 (one FSDP unit per stage or per
layer) sharding the dense parameters while ep splits the experts."""

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


@pytest.mark.parametrize(("world", "pp", "ep", "names", "zero", "units"), [
    (2, 1, 2, ["mixtral", "qwen3_moe", "deepseek_v3"], 0, False),
    (4, 2, 2, ["qwen3_moe"], 0, False),
    (4, 1, 4, ["deepseek_v3"], 0, False),
    (4, 1, 2, ["mixtral"], 1, True),
    (4, 2, 2, ["deepseek_v3"], 3, True),
], ids=["dp2-ep2", "pp2xdp2-ep2", "dp4-ep4", "dp4-ep2-zero1-layers", "pp2xdp2-ep2-zero3-layers"])
def test_loss_every_gradient_state_and_norm_match_the_plain_model(
        world: int, pp: int, ep: int, names: list[str], zero: int, units: bool) -> None:
    with tempfile.TemporaryDirectory() as out:
        script = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(ROOT)!r})
            import torch.multiprocessing as mp
            from tests.distributed.ep_worker import ep_numerics
            if __name__ == "__main__":
                mp.spawn(ep_numerics, nprocs={world}, join=True,
                         args=({world}, {_free_port()}, {out!r}, {pp}, {ep}, {names!r}, {zero},
                               {units}))
        """)
        proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                              text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        problems = {r: json.loads((Path(out) / f"{r}.json").read_text()) for r in range(world)}
    assert problems == {r: [] for r in range(world)}
