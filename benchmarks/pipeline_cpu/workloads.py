"""Workloads where balance matters (issue 17): a ResNet-50, a T5 encoder-decoder and a funnel
transformer with heterogeneous blocks, each as a model for autopart and as DeepSpeed's layer list.

Every builder takes its sizes as arguments (defaults: the benchmark's sizes, one unpartitioned
training step with m = 8 microbatches of about 1.5-3 s on one thread of this project's 2-core
CPU; the tests use tiny sizes). Each model's layer list is first written in a plain form
(:func:`plain_layers`): ``nn.Module`` instances taken from the model itself, and
:class:`TiedLayer` entries for a weight that several layers read (T5's shared embedding).
:func:`run_layers` runs that list in one process, as DeepSpeed's ``PipelineModule.forward``
would; :func:`to_deepspeed` turns it into DeepSpeed's list (``TiedLayerSpec`` for the tied
entries), importing DeepSpeed only then. Both compute ``model(*inputs)`` exactly, with the
model's own parameters.

DeepSpeed's pipeline engine sends tuples of tensors between stages and, in the backward,
sends back the gradient of every floating-point tensor it received (``assert buffer.grad is not
None``, ``deepspeed/runtime/pipe/engine.py``); integer tensors travel without gradients. So
each layer passes on only what a later layer reads: T5's relative position bias (computed by
the first block of each stack from its parameters) travels with the hidden states until the
last block of its stack, the decoder's token ids (integers) cross the encoder, the encoder's
output crosses the decoder; masks and T5's all-zero cross-attention bias are recomputed
where they are needed, never sent.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autopart.core.errors import UsageError
from benchmarks.pipeline_cpu.peer_workload import PeerWorkload

__all__ = ["WORKLOADS", "TiedLayer", "plain_layers", "run_layers", "to_deepspeed",
           "resnet50_workload", "t5_workload", "hetero_workload", "ResNet50", "Funnel"]

M = 8
"""Microbatches per step, every workload and arm."""


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; logits ``(..., classes)``, target ``(...)`` class indices."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# --------------------------------------------------------------------------------------------
# the plain layer list and its DeepSpeed form


@dataclass(frozen=True)
class TiedLayer:
    """A layer list entry that reads a module shared with other entries of the same ``key``.

    Attributes:
        key: entries with the same key share ``module`` (DeepSpeed all-reduces its
            ``tied_weight_attr`` gradients between the stages that hold it).
        module: the shared module, taken from the model.
        forward_fn: ``forward_fn(module, x) -> y`` for this entry.
        tied_weight_attr: the shared parameters' names in ``module``.
    """

    key: str
    module: nn.Module
    forward_fn: Callable[[nn.Module, Any], Any]
    tied_weight_attr: tuple[str, ...] = ("weight",)


class _Hold(nn.Module):
    """What a DeepSpeed ``TiedLayerSpec`` builds: the model's own module, held as ``.module``
    (``LayerSpec`` needs an ``nn.Module`` class to call; this one returns the given module)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def _held(fn: Callable[[nn.Module, Any], Any], hold: _Hold, x: Any) -> Any:
    return fn(hold.module, x)


def run_layers(layers: list[nn.Module | TiedLayer], x: Any) -> Any:
    """Run a plain layer list in order, each layer on the previous one's output (``x``: the
    first layer's input, a tensor or a tuple of tensors), as DeepSpeed's ``PipelineModule``."""
    for layer in layers:
        x = layer.forward_fn(layer.module, x) if isinstance(layer, TiedLayer) else layer(x)
    return x


def to_deepspeed(layers: list[nn.Module | TiedLayer]) -> list[Any]:
    """DeepSpeed's layer list for ``PipelineModule(layers=...)``: modules as they are, each
    :class:`TiedLayer` as a ``TiedLayerSpec`` building the model's own module. Imports
    DeepSpeed (an optional benchmark extra) only when there is a tied entry."""
    if not any(isinstance(layer, TiedLayer) for layer in layers):
        return list(layers)
    try:
        from deepspeed.pipe import TiedLayerSpec
    except ImportError as exc:
        raise ImportError("this layer list ties a weight across layers, which needs DeepSpeed's "
                          "TiedLayerSpec; install the benchmark extra: DS_BUILD_OPS=0 "
                          "DS_ACCELERATOR=cpu pip install deepspeed==0.19.8") from exc

    return [TiedLayerSpec(layer.key, _Hold, layer.module,
                          forward_fn=functools.partial(_held, layer.forward_fn),
                          tied_weight_attr=[f"module.{a}" for a in layer.tied_weight_attr])
            if isinstance(layer, TiedLayer) else layer for layer in layers]


def plain_layers(name: str, model: nn.Module) -> list[nn.Module | TiedLayer]:
    """The plain layer list of workload ``name`` for ``model`` (built by its ``build``).

    Raises:
        UsageError: an unknown workload name.
    """
    if name not in _PLAIN:
        raise UsageError(f"no workload {name!r}; choose one of {sorted(_PLAIN)}")
    return _PLAIN[name](model)


def _single_batch(inputs: tuple[Any, ...], target: Any) -> tuple[Any, Any]:
    return inputs[0], target


def _tuple_batch(inputs: tuple[Any, ...], target: Any) -> tuple[Any, Any]:
    return tuple(inputs), target


# --------------------------------------------------------------------------------------------
# ResNet-50 (GroupNorm)


def _groups(channels: int) -> int:
    return math.gcd(32, channels)


class Bottleneck(nn.Module):
    """ResNet bottleneck (v1.5: the stride on the 3x3 conv), GroupNorm after every conv.

    x: (batch, cin, h, w) -> (batch, 4 * width, h / stride, w / stride)."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        out = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.norm1 = nn.GroupNorm(_groups(width), width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.norm2 = nn.GroupNorm(_groups(width), width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.norm3 = nn.GroupNorm(_groups(out), out)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False),
                                         nn.GroupNorm(_groups(out), out))
                           if stride != 1 or cin != out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        y = self.norm3(self.conv3(y))
        return F.relu(y + self.downsample(x))


class ResNet50(nn.Module):
    """ResNet-50 (He et al. 2016, arXiv:1512.03385; v1.5 strides) with GroupNorm, 32 groups
    (Wu & He 2018, arXiv:1803.08494) instead of BatchNorm: a microbatch's statistics then do
    not depend on the other rows, so a pipeline's accumulated gradient equals the full batch's.

    Stem (7x7 conv stride 2, norm, ReLU, 3x3 max-pool stride 2), 3/4/6/3 bottlenecks of widths
    64/128/256/512 x ``width`` (outputs 4x that), global average pool, one linear layer.

    images: (batch, 3, h, w) -> logits (batch, num_classes).
    """

    def __init__(self, *, width: float = 1.0, num_classes: int = 1000,
                 depths: tuple[int, ...] = (3, 4, 6, 3)) -> None:
        super().__init__()
        base = [int(64 * width * 2 ** i) for i in range(len(depths))]
        self.stem = nn.Sequential(nn.Conv2d(3, base[0], 7, 2, 3, bias=False),
                                  nn.GroupNorm(_groups(base[0]), base[0]), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        cin = base[0]
        for i, (depth, w) in enumerate(zip(depths, base, strict=True)):
            blocks = []
            for j in range(depth):
                blocks.append(Bottleneck(cin, w, 2 if j == 0 and i > 0 else 1))
                cin = 4 * w
            self.add_module(f"layer{i + 1}", nn.Sequential(*blocks))
        self.depths = tuple(depths)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))

    def stages(self) -> list[nn.Sequential]:
        """``layer1`` ... ``layer4``."""
        return [getattr(self, f"layer{i + 1}") for i in range(len(self.depths))]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for stage in self.stages():
            x = stage(x)
        out: torch.Tensor = self.head(x)
        return out


def _resnet_layers(model: nn.Module) -> list[nn.Module | TiedLayer]:
    assert isinstance(model, ResNet50)
    return [model.stem, *[b for stage in model.stages() for b in stage], model.head]


def _resnet_hand_split(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.pipelining import SplitPoint

    assert isinstance(model, ResNet50)
    names = [f"layer{i + 1}.{j}" for i, d in enumerate(model.depths) for j in range(d)]
    return {names[len(names) // 2]: SplitPoint.BEGINNING}


def resnet50_workload(*, image: int = 224, batch: int = 48, width: float = 0.25,
                      num_classes: int = 1000, depths: tuple[int, ...] = (3, 4, 6, 3),
                      num_microbatches: int = M) -> PeerWorkload:
    """ResNet-50 (GroupNorm) on ``batch`` random ``image`` x ``image`` RGB images, cross-entropy
    on random labels. Most parameters sit in the last stage (``layer4``), while the time goes
    to the early, high-resolution layers.

    The defaults keep ImageNet's 224 x 224 resolution and narrow the network (width x0.25,
    batch 48: microbatches of 6) to fit one thread. How much of the time sits early depends
    on the size: on this project's CPU the profile puts half the step in the stem and
    ``layer1`` at these defaults, in the stem to ``layer2`` at width x0.5 / batch 16, and at
    96 x 96 full width the late layers cost more per block (their weight traffic dominates
    microbatches of 2)."""

    def build() -> tuple[nn.Module, tuple[Any, ...], Any, Callable[[Any, Any], torch.Tensor]]:
        torch.manual_seed(0)
        model = ResNet50(width=width, num_classes=num_classes, depths=depths)
        gen = torch.Generator().manual_seed(1)
        images = torch.randn(batch, 3, image, image, generator=gen)
        labels = torch.randint(0, num_classes, (batch,), generator=gen)
        return model, (images,), labels, _cross_entropy

    return PeerWorkload(
        name="resnet50",
        description=(f"ResNet-50 (GroupNorm; 3/4/6/3 bottlenecks, width x{width:g}), {image}x{image} "
                     f"images, {num_classes} classes: parameters at the end, compute at the start"),
        batch=batch, num_microbatches=num_microbatches, build=build,
        ds_layers=lambda model: to_deepspeed(_resnet_layers(model)),
        ds_loss_fn=_cross_entropy, ds_batch=_single_batch, ds_type_regex="Bottleneck",
        hand_split=_resnet_hand_split)


# --------------------------------------------------------------------------------------------
# T5 encoder-decoder


class T5Seq2Seq(nn.Module):
    """``transformers``' T5ForConditionalGeneration returning its logits.

    input_ids: (batch, src) int64, decoder_input_ids: (batch, tgt) int64 -> (batch, tgt, vocab).
    """

    t5: Any  # transformers' model: its attributes are untyped

    def __init__(self, t5: nn.Module) -> None:
        super().__init__()
        self.t5 = t5

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.t5(input_ids=input_ids, decoder_input_ids=decoder_input_ids,
                                       use_cache=False).logits
        return logits


class T5BlockPipe(nn.Module):
    """One T5 block as a DeepSpeed layer, with the masks its stack would give it.

    Encoder block: ``(h[, bias], dec_ids) -> (h[, bias], dec_ids)``; decoder block:
    ``(h, enc[, bias]) -> (h, enc[, bias])``, the last one ``-> h``. The first block of a stack
    computes the relative position bias (``bias``, (1, heads, q, k)); later blocks read it; the
    last block drops it. h: (batch, seq, d_model), enc: (batch, src, d_model).
    """

    def __init__(self, block: nn.Module, config: Any, *, first: bool, last: bool) -> None:
        super().__init__()
        self.block, self.config, self.first, self.last = block, config, first, last
        self.is_decoder = bool(config.is_decoder)

    def forward(self, x: tuple[torch.Tensor, ...]) -> Any:
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        if self.is_decoder:
            h, enc = x[0], x[1]
            bias = None if self.first else x[2]
            mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                      past_key_values=None)
            cross = create_bidirectional_mask(config=self.config, inputs_embeds=h,
                                              attention_mask=None, encoder_hidden_states=enc)
            # the cross-attention bias is all zeros (no relative bias): each block makes its own
            h, bias, _ = self.block(h, mask, bias, enc, cross, None)
            return h if self.last else (h, enc, bias)
        h, dec_ids = x[0], x[-1]
        bias = None if self.first else x[1]
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=h, attention_mask=None)
        h, bias, _ = self.block(h, mask, bias)
        return (h, dec_ids) if self.last else (h, bias, dec_ids)


class T5NormPipe(nn.Module):
    """A stack's final norm and dropout on ``x[0]``, the rest of the tuple passed on."""

    def __init__(self, stack: Any) -> None:
        super().__init__()
        self.norm: nn.Module = stack.final_layer_norm
        self.dropout: nn.Module = stack.dropout

    def forward(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return self.dropout(self.norm(x))
        return (self.dropout(self.norm(x[0])), *x[1:])


def _t5_embed_encoder(shared: nn.Module, x: tuple[torch.Tensor, torch.Tensor]) -> Any:
    ids, dec_ids = x  # (batch, src), (batch, tgt)
    return shared(ids), dec_ids  # dropout is off (rate 0) in this workload


def _t5_embed_decoder(shared: nn.Module, x: tuple[torch.Tensor, torch.Tensor]) -> Any:
    enc, dec_ids = x
    return shared(dec_ids), enc


def _t5_head(scale: float, shared: Any, h: torch.Tensor) -> torch.Tensor:
    return F.linear(h * scale, shared.weight)  # (batch, tgt, vocab)


def _t5_layers(model: nn.Module) -> list[nn.Module | TiedLayer]:
    assert isinstance(model, T5Seq2Seq)
    t5 = model.t5
    if t5.config.dropout_rate:
        raise UsageError(f"the T5 layer list needs dropout_rate 0 (got {t5.config.dropout_rate}):"
                         " its embedding layers leave out the stacks' embedding dropout")
    layers: list[nn.Module | TiedLayer] = [TiedLayer("shared", t5.shared, _t5_embed_encoder)]
    for stack in (t5.encoder, t5.decoder):
        if stack is t5.decoder:
            layers.append(TiedLayer("shared", t5.shared, _t5_embed_decoder))
        n = len(stack.block)
        layers += [T5BlockPipe(b, stack.config, first=i == 0, last=i == n - 1)
                   for i, b in enumerate(stack.block)]
        layers.append(T5NormPipe(stack))
    scale = float(t5.model_dim) ** -0.5 if t5.config.scale_decoder_outputs else 1.0
    if t5.lm_head.weight is t5.shared.weight:
        layers.append(TiedLayer("shared", t5.shared, functools.partial(_t5_head, scale)))
    else:  # untied head (tie_word_embeddings=False): a plain layer
        layers.append(_ScaledHead(t5.lm_head, scale))
    return layers


class _ScaledHead(nn.Module):
    def __init__(self, head: nn.Module, scale: float) -> None:
        super().__init__()
        self.head, self.scale = head, scale

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h * self.scale)  # type: ignore[no-any-return]


def _t5_hand_split(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.pipelining import SplitPoint

    assert isinstance(model, T5Seq2Seq)
    names = ([f"t5.encoder.block.{i}" for i in range(len(model.t5.encoder.block))]
             + [f"t5.decoder.block.{i}" for i in range(len(model.t5.decoder.block))])
    return {names[len(names) // 2]: SplitPoint.BEGINNING}


def t5_workload(*, batch: int = 16, src: int = 256, tgt: int = 128, d_model: int = 256,
                d_ff: int = 1024, heads: int = 4, layers: int = 4, vocab: int = 8000,
                tie: bool = True, num_microbatches: int = M) -> PeerWorkload:
    """T5 (transformers' T5ForConditionalGeneration from a T5Config, random weights, dropout
    off): ``layers`` encoder and ``layers`` decoder blocks, the LM head tied to the shared
    embedding when ``tie``; random source ids (batch, src), random labels (batch, tgt), the
    decoder reading the labels shifted right (``prepare_decoder_input_ids_from_labels``);
    cross-entropy."""

    def build() -> tuple[nn.Module, tuple[Any, ...], Any, Callable[[Any, Any], torch.Tensor]]:
        from transformers import T5Config, T5ForConditionalGeneration

        torch.manual_seed(0)
        fields: dict[str, Any] = dict(
            vocab_size=vocab, d_model=d_model, d_kv=d_model // heads, d_ff=d_ff, num_layers=layers,
            num_decoder_layers=layers, num_heads=heads, dropout_rate=0.0, use_cache=False,
            tie_word_embeddings=tie, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
        t5: Any = T5ForConditionalGeneration(T5Config(**fields))
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(2, vocab, (batch, src), generator=gen)
        labels = torch.randint(2, vocab, (batch, tgt), generator=gen)
        return T5Seq2Seq(t5), (ids, t5.prepare_decoder_input_ids_from_labels(labels)), labels, _cross_entropy

    return PeerWorkload(
        name="t5_encdec",
        description=(f"T5 encoder-decoder, {layers}+{layers} blocks, d_model {d_model}, d_ff "
                     f"{d_ff}, vocab {vocab}{' (head tied)' if tie else ''}, source {src} / "
                     f"target {tgt} tokens"),
        batch=batch, num_microbatches=num_microbatches, build=build,
        ds_layers=lambda model: to_deepspeed(_t5_layers(model)),
        ds_loss_fn=_cross_entropy, ds_batch=_tuple_batch, ds_type_regex="T5BlockPipe",
        hand_split=_t5_hand_split)


# --------------------------------------------------------------------------------------------
# funnel transformer: heterogeneous blocks


class FunnelEmbed(nn.Module):
    """Token + learned position embedding: ids (batch, seq) -> (batch, seq, dim)."""

    def __init__(self, vocab: int, seq: int, dim: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.randn(seq, dim) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tokens(ids) + self.positions
        return out


class FunnelBlock(nn.Module):
    """Pre-norm transformer encoder block (bidirectional attention, GELU MLP of ``mlp`` x dim).

    x: (batch, seq, dim) -> (batch, seq, dim)."""

    def __init__(self, dim: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, mlp * dim), nn.Linear(mlp * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        # q, k, v: (batch, seq, heads, head_dim) -> (batch, heads, seq, head_dim)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return out


class FunnelPool(nn.Module):
    """Funnel step: mean over each ``stride`` consecutive positions, then widen.

    x: (batch, seq, dim) -> (batch, seq / stride, out)."""

    def __init__(self, stride: int, dim: int, out: int) -> None:
        super().__init__()
        self.stride = stride
        self.norm, self.widen = nn.LayerNorm(dim), nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        pooled = x.view(b, s // self.stride, self.stride, d).mean(2)  # (batch, seq / stride, dim)
        out: torch.Tensor = self.widen(self.norm(pooled))
        return out


class FunnelHead(nn.Module):
    """Final norm, mean over positions, classifier: (batch, seq, dim) -> (batch, classes)."""

    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.norm(x).mean(1))
        return out


class Funnel(nn.Module):
    """A funnel (hierarchical) transformer encoder for classification, in the manner of
    Funnel-Transformer (Dai et al. 2020, arXiv:2006.03236) and pyramid vision transformers:
    ``depth_a`` blocks over the full sequence at width ``dim_a``, a pooling step that shortens
    the sequence by ``stride`` and widens it to ``dim_b``, ``depth_b`` blocks there, a head.

    The two halves cost very differently per parameter: a full-length block's time is mostly
    its long attention and per-token work over ``seq`` positions; a pooled block holds far more
    parameters (wider) but runs on ``seq / stride`` positions.

    ids: (batch, seq) int64 -> logits (batch, classes).
    """

    def __init__(self, *, vocab: int, seq: int, dim_a: int, dim_b: int, heads: int,
                 depth_a: int, depth_b: int, mlp_a: int, mlp_b: int, stride: int,
                 classes: int) -> None:
        super().__init__()
        self.depth_a = depth_a
        self.embed = FunnelEmbed(vocab, seq, dim_a)
        self.blocks = nn.ModuleList([FunnelBlock(dim_a, heads, mlp_a) for _ in range(depth_a)]
                                    + [FunnelBlock(dim_b, heads, mlp_b) for _ in range(depth_b)])
        self.pool = FunnelPool(stride, dim_a, dim_b)
        self.head = FunnelHead(dim_b, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for i, block in enumerate(self.blocks):
            if i == self.depth_a:
                x = self.pool(x)
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def _funnel_layers(model: nn.Module) -> list[nn.Module | TiedLayer]:
    assert isinstance(model, Funnel)
    blocks = list(model.blocks)
    return [model.embed, *blocks[:model.depth_a], model.pool, *blocks[model.depth_a:], model.head]


def _funnel_hand_split(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.pipelining import SplitPoint

    assert isinstance(model, Funnel)
    return {f"blocks.{len(model.blocks) // 2}": SplitPoint.BEGINNING}


def hetero_workload(*, batch: int = 16, seq: int = 512, dim_a: int = 192, dim_b: int = 512,
                    heads: int = 4, depth_a: int = 4, depth_b: int = 6, mlp_a: int = 4,
                    mlp_b: int = 4, stride: int = 16, vocab: int = 4000, classes: int = 10,
                    num_microbatches: int = M) -> PeerWorkload:
    """The funnel transformer (:class:`Funnel`) on random token ids, cross-entropy on random
    class labels."""

    def build() -> tuple[nn.Module, tuple[Any, ...], Any, Callable[[Any, Any], torch.Tensor]]:
        torch.manual_seed(0)
        model = Funnel(vocab=vocab, seq=seq, dim_a=dim_a, dim_b=dim_b, heads=heads,
                       depth_a=depth_a, depth_b=depth_b, mlp_a=mlp_a, mlp_b=mlp_b,
                       stride=stride, classes=classes)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        labels = torch.randint(0, classes, (batch,), generator=gen)
        return model, (ids,), labels, _cross_entropy

    return PeerWorkload(
        name="hetero",
        description=(f"funnel transformer: {depth_a} blocks at {seq} tokens x {dim_a}, pool /{stride} "
                     f"+ widen, {depth_b} blocks at {seq // stride} tokens x {dim_b} (MLP "
                     f"{mlp_a}x / {mlp_b}x): time in the first half, parameters in the second"),
        batch=batch, num_microbatches=num_microbatches, build=build,
        ds_layers=lambda model: to_deepspeed(_funnel_layers(model)),
        ds_loss_fn=_cross_entropy, ds_batch=_single_batch, ds_type_regex="FunnelBlock",
        hand_split=_funnel_hand_split)


_PLAIN: dict[str, Callable[[nn.Module], list[nn.Module | TiedLayer]]] = {
    "resnet50": _resnet_layers, "t5_encdec": _t5_layers, "hetero": _funnel_layers}

WORKLOADS: dict[str, PeerWorkload] = {
    w.name: w for w in (resnet50_workload(), t5_workload(), hetero_workload())}
"""The benchmark's workloads at its sizes, by name."""
