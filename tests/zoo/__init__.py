"""Small models with random weights for tests (nothing downloaded), dropout off."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Builder = Callable[[], tuple[nn.Module, tuple[Any, ...], Any, Callable[[Any, Any], torch.Tensor]]]

BATCH = 8


def _lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # (batch, seq, vocab)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def gpt2() -> tuple[nn.Module, tuple[Any, ...], Any, Callable[[Any, Any], torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=512, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    x = torch.randint(0, 512, (BATCH, 16))
    return model, (x,), torch.randint(0, 512, (BATCH, 16)), _lm_loss


def bert() -> tuple[nn.Module, tuple[Any, ...], Any, Callable[[Any, Any], torch.Tensor]]:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                     intermediate_size=128, vocab_size=512, max_position_embeddings=64,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(cfg)
    x = torch.randint(0, 512, (BATCH, 16))
    return model, (x,), torch.randint(0, 512, (BATCH, 16)), _lm_loss


def resnet() -> tuple[nn.Module, tuple[Any, ...], Any, Callable[[Any, Any], torch.Tensor]]:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 2, 1],
                       layer_type="basic", num_labels=10)
    # BatchNorm statistics depend on the microbatch (as in GPipe): compare in eval mode.
    model = ResNetForImageClassification(cfg).eval()
    x = torch.randn(BATCH, 3, 32, 32)

    def loss(out: Any, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits, target)

    return model, (x,), torch.randint(0, 10, (BATCH,)), loss


def mlp() -> tuple[nn.Module, tuple[Any, ...], Any, Callable[[Any, Any], torch.Tensor]]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(32, 32), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(32, 4))
    x = torch.randn(BATCH, 32)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target)

    return model, (x,), torch.randn(BATCH, 4), loss


class SkipMLP(nn.Module):
    """An MLP whose input skip connection is read by the last layer (crosses every cut)."""

    def __init__(self, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.inp(x)  # (batch, width)
        h = skip
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.out(h + skip)  # (batch, 4)


def skip_mlp() -> tuple[nn.Module, tuple[Any, ...], Any, Callable[[Any, Any], torch.Tensor]]:
    torch.manual_seed(0)
    model = SkipMLP()

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target)

    return model, (torch.randn(BATCH, 32),), torch.randn(BATCH, 4), loss


def llama() -> tuple[nn.Module, tuple[Any, ...], Any, Callable[[Any, Any], torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                      max_position_embeddings=64, use_cache=False)
    model = LlamaForCausalLM(cfg)
    x = torch.randint(0, 512, (BATCH, 16))
    return model, (x,), torch.randint(0, 512, (BATCH, 16)), _lm_loss


def vit() -> tuple[nn.Module, tuple[Any, ...], Any, Callable[[Any, Any], torch.Tensor]]:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                    intermediate_size=128, image_size=32, patch_size=8, num_labels=10,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = ViTForImageClassification(cfg)

    def loss(out: Any, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits, target)

    return model, (torch.randn(BATCH, 3, 32, 32),), torch.randint(0, 10, (BATCH,)), loss


class TiedMLP(nn.Module):
    """The input projection's weight is read again by the output (like GPT-2's wte / lm_head)."""

    def __init__(self, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.proj = nn.Linear(16, width, bias=False)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # (batch, width)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return h @ self.proj.weight  # (batch, 16): the tied weight again, in the last stage


def tied_mlp() -> tuple[nn.Module, tuple[Any, ...], Any, Callable[[Any, Any], torch.Tensor]]:
    torch.manual_seed(0)
    model = TiedMLP()

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target)

    return model, (torch.randn(BATCH, 16),), torch.randn(BATCH, 16), loss


ZOO: dict[str, Builder] = {"gpt2": gpt2, "bert": bert, "resnet": resnet, "mlp": mlp,
                           "skip_mlp": skip_mlp, "llama": llama, "vit": vit, "tied_mlp": tied_mlp}
