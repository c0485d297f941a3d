"""Small models shared by the profiler tests (random weights, dropout off)."""

from __future__ import annotations

from typing import Any

import torch

V, D, L, B, T = 1000, 64, 2, 4, 16


def small_gpt2(attn_pdrop: float = 0.0) -> tuple[Any, torch.Tensor]:
    """A 2-layer GPT-2 (n_embd 64, vocab 1000) in train mode, attention dropout
    ``attn_pdrop`` (no other dropout), and a (4, 16) token batch."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=L, n_embd=D, n_head=4, vocab_size=V, n_positions=64,
                                  resid_pdrop=0, embd_pdrop=0, attn_pdrop=attn_pdrop, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg), torch.randint(0, V, (B, T))
