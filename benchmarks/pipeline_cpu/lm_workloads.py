"""The language-model rows of ``peers.py``: GPT-2-like models, balanced and head-heavy.

``gpt2_balanced`` is the control (8 blocks, n_embd 256, vocab 2000: the tied head costs
about one block). ``gpt2_head_heavy`` has the same blocks and a vocabulary of 32000 (set
``$AUTOPART_PEERS_HEAD_VOCAB``, or ``peers.py --head-vocab``, for 16000 or 50000 rows): its
head costs several blocks, so splitting the blocks evenly, or by parameter count, leaves one
stage far busier. Both: batch 16 x 128 tokens, m = 8, next-token cross entropy
(:func:`autopart.apps.demo.gpt2_loss`), random weights from seed 0, dropout off.

DeepSpeed sees the model as the layer list ``[embedding, block x n_layer, ln_f, head]``: the
embedding (``wte`` + ``wpe``) and the head are one ``TiedLayerSpec("embed", ...)``, the head
computing ``hidden @ wte.T`` through ``forward_fn``, exactly as ``GPT2LMHeadModel`` ties
``lm_head.weight`` to ``wte.weight``.
"""

from __future__ import annotations

import os
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from benchmarks.pipeline_cpu.peer_workload import PeerWorkload

__all__ = ["WORKLOADS", "TINY", "GPT2Embedding", "tied_logits", "gpt2_workload", "lm_loss",
           "HEAD_VOCAB_ENV"]

#: environment variable: the head-heavy model's vocabulary (default 32000)
HEAD_VOCAB_ENV = "AUTOPART_PEERS_HEAD_VOCAB"


class GPT2Embedding(nn.Module):
    """GPT-2's input embedding as one pipeline layer: ``wte[ids] + wpe[0..seq)``.

    Holds the token matrix as ``weight`` (the tied attribute DeepSpeed's ``TiedLayerSpec``
    reads by default) and copies both matrices, so every stage that builds it starts from
    the model's weights.

    Args:
        wte: token embedding ``(vocab, n_embd)``; wpe: position embedding
            ``(n_positions, n_embd)``.
    """

    def __init__(self, wte: torch.Tensor, wpe: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(wte.detach().clone())
        self.wpe = nn.Embedding.from_pretrained(wpe.detach().clone(), freeze=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(batch, seq)`` token ids -> ``(batch, seq, n_embd)`` hidden states."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return nn.functional.embedding(input_ids, self.weight) + self.wpe(positions)


def tied_logits(embedding: GPT2Embedding, hidden: torch.Tensor) -> torch.Tensor:
    """The tied head: ``(batch, seq, n_embd)`` -> logits ``(batch, seq, vocab)``."""
    return nn.functional.linear(hidden, embedding.weight)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on raw logits, as :func:`autopart.apps.demo.gpt2_loss`."""
    from autopart.apps.demo import gpt2_loss

    return gpt2_loss(SimpleNamespace(logits=logits), labels)


def _build(*, n_layer: int, n_embd: int, n_head: int, vocab: int, batch: int,
           seq: int) -> tuple[nn.Module, tuple[Any, ...], Any, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    from autopart.apps.demo import gpt2_loss

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                     n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_cache=False, bos_token_id=0, eos_token_id=0,
                     attn_implementation="sdpa")  # the DS blocks rely on sdpa's is_causal
    model = GPT2LMHeadModel(cfg).train()
    tokens = torch.randint(0, vocab, (batch, seq))  # (batch, seq)
    return model, (tokens,), tokens, gpt2_loss


def _ds_layers(model: nn.Module) -> list[Any]:
    from deepspeed.pipe import TiedLayerSpec

    tr = model.transformer  # type: ignore[attr-defined]
    embed = partial(TiedLayerSpec, "embed", GPT2Embedding, tr.wte.weight, tr.wpe.weight)
    # GPT2Block(hidden) with no mask is causal (sdpa's is_causal), as inside GPT2Model
    return [embed(), *tr.h, tr.ln_f, embed(forward_fn=tied_logits)]


def _hand_split(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.pipelining import SplitPoint

    n_layer = len(model.transformer.h)  # type: ignore[attr-defined]
    return {f"transformer.h.{n_layer // 2}": SplitPoint.BEGINNING}


def gpt2_workload(name: str, description: str, *, vocab: int, n_layer: int = 8, n_embd: int = 256,
                  n_head: int = 8, batch: int = 16, seq: int = 128, m: int = 8) -> PeerWorkload:
    """A GPT-2-like :class:`PeerWorkload` (``GPT2LMHeadModel``, tied head, dropout off).

    Args:
        name, description: the row's key and one-line description.
        vocab: vocabulary rows; n_layer, n_embd, n_head: the blocks (default 8, 256, 8).
        batch, seq: tokens per step ``(batch, seq)`` (default 16 x 128); m: microbatches
            (default 8; must divide ``batch``).
    """
    return PeerWorkload(
        name=name, description=description, batch=batch, num_microbatches=m,
        build=partial(_build, n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab=vocab,
                      batch=batch, seq=seq),
        ds_layers=_ds_layers, ds_loss_fn=lm_loss,
        ds_batch=lambda inputs, target: (inputs[0], target),
        ds_type_regex="GPT2Block", hand_split=_hand_split)


def _head_vocab() -> int:
    raw = os.environ.get(HEAD_VOCAB_ENV, "32000")
    if not raw.isdigit() or int(raw) < 2:
        raise ValueError(f"${HEAD_VOCAB_ENV}={raw!r}: expected a vocabulary size, e.g. 16000")
    return int(raw)


_VOCAB = _head_vocab()
WORKLOADS: dict[str, PeerWorkload] = {
    "gpt2_balanced": gpt2_workload(
        "gpt2_balanced", "GPT-2-like, 8 blocks, n_embd 256, vocab 2000 (control: head ~ one "
        "block), batch 16 x 128", vocab=2000),
    "gpt2_head_heavy": gpt2_workload(
        "gpt2_head_heavy", f"GPT-2-like, 8 blocks, n_embd 256, vocab {_VOCAB} (head-heavy), "
        "batch 16 x 128", vocab=_VOCAB),
}
#: CI-sized rows for tests (never run by default)
TINY: dict[str, PeerWorkload] = {
    "gpt2_tiny": gpt2_workload("gpt2_tiny", "GPT-2-like, 2 blocks, n_embd 32, vocab 96, "
                               "batch 4 x 16 (tests)", vocab=96, n_layer=2, n_embd=32,
                               n_head=2, batch=4, seq=16, m=2),
}
