"""Tiny random-weight models for every architecture in transformers' auto mappings.

Used by ``benchmarks/zoo/run.py`` (the sweep) and ``tests/zoo/`` (its CI-sized subset).
Nothing is downloaded: each model is built from its config class with shrunk sizes.

A *family* is one of transformers' auto mappings (:data:`FAMILIES`); an *entry* is one
model class in it. :func:`build` returns the model, its inputs (keyword tensors, batch
:data:`BATCH` in dim 0) and a loss over its logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

BATCH = 4
"""Rows per batch; the sweep splits it into 2 microbatches of 2 (export specialises size 1)."""
SEQ = 16
"""Tokens per row for text inputs (decoder inputs: ``SEQ // 2``)."""

CI_SUBSET: dict[str, tuple[str, ...]] = {
    # model types, by family, of the CI-sized slice (tests/zoo) and of the tp = 2 arm
    # (benchmarks/zoo/tp.py); each one stands for a pattern the sweep found or must keep
    "causal_lm": ("gpt2", "llama", "gpt_neox", "bloom", "opt", "qwen2_moe", "falcon"),
    "masked_lm": ("bert", "roberta", "albert", "deberta-v2"),
    "seq2seq_lm": ("t5", "bart"),  # t5: the strided attention-output view (issue 14)
    "speech_seq2seq": ("whisper", "speech_to_text"),
    "image_classification": ("vit", "resnet", "convnext"),  # resnet: BatchNorm in training
    "audio_classification": ("wav2vec2", "audio-spectrogram-transformer"),
}

FAMILIES: dict[str, str] = {  # in this order: a model type runs in its first family
    "seq2seq_lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "speech_seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "image_classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "audio_classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
}
"""Family name -> the ``transformers.models.auto.modeling_auto`` mapping it comes from."""

# Generic shrink: config field -> tiny value. Fields a config does not have are skipped.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 64, 4, 2, 16, 128, 2, 256
_SHRINK: dict[str, Any] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "hidden_dim",
                     "word_embed_proj_dim", "d_embed", "n_embed", "embedding_dim"), HIDDEN),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_heads", "encoder_num_attention_heads",
                     "decoder_num_attention_heads", "num_decoder_attention_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads",
                     "multi_query_group_num"), KV_HEADS),
    **dict.fromkeys(("head_dim", "d_kv", "attention_head_dim", "qk_nope_head_dim",
                     "v_head_dim", "qk_rope_head_dim", "kv_channels"), HEAD_DIM),
    **dict.fromkeys(("intermediate_size", "d_ff", "ffn_dim", "encoder_ffn_dim",
                     "decoder_ffn_dim", "n_inner", "intermediate_dim", "d_inner",
                     "ffn_hidden_size", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "expert_intermediate_size",
                     "mlp_dim", "dim_feedforward"), FFN),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "encoder_layers",
                     "decoder_layers", "num_decoder_layers", "n_layers", "num_encoder_layers",
                     "encoder_num_hidden_layers", "decoder_num_hidden_layers"), LAYERS),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"),
                    4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts",
                     "moe_k", "num_experts_per_token"), 2),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group"), 1),
    "vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": HEAD_DIM,
    "num_kv_shared_layers": 0,
    "backbone_hidden_size": HIDDEN,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "image_size": 32,
    "patch_size": 8,
    "num_labels": 5,
    "use_cache": False,
    "output_hidden_states": False,
    "output_attentions": False,
    "tie_word_embeddings": True,
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
              "sep_token_id", "cls_token_id", "mask_token_id", "unk_token_id")
_LIST_SHRINK = {"hidden_sizes": 16, "embed_dims": 16, "conv_dim": 32, "neck_hidden_sizes": 16,
                "hidden_dims": 16}
_PER_STAGE: dict[str, Callable[[int], Any]] = {  # a per-stage list for a scalar field
    **dict.fromkeys(("hidden_size", "embed_dim", "hidden_dim", "dim"), lambda i: 16 * (1 + i // 2)),
    **dict.fromkeys(("num_attention_heads", "num_heads", "n_heads"), lambda i: 2),
    "image_size": lambda i: 32,
}
"""Stage ``i``'s value where a field of :data:`_SHRINK` is a list (widths 16, 16, 32, 32 as
in :data:`_LIST_SHRINK`, 2 heads each)."""
_LIST_ONES = ("depths", "num_layers_per_stage", "layer_depths", "block_repeats")

# Per-model overrides where the generic shrink cannot work (applied last, to the top config).
OVERRIDES: dict[str, dict[str, Any]] = {
    "whisper": {"max_source_positions": 16, "max_target_positions": 32, "num_mel_bins": 16},
    "moonshine": {},
    "speech_to_text": {"max_source_positions": 64, "input_feat_per_channel": 16},
    "swin": {"image_size": 32, "patch_size": 2, "window_size": 2, "embed_dim": 16},
    "swinv2": {"image_size": 32, "patch_size": 2, "window_size": 2, "embed_dim": 16},
    "donut-swin": {"image_size": 32, "patch_size": 2, "window_size": 2, "embed_dim": 16},
    "maskformer-swin": {"image_size": 32, "patch_size": 2, "window_size": 2, "embed_dim": 16},
    "audio-spectrogram-transformer": {"max_length": 64, "num_mel_bins": 16, "patch_size": 8,
                                      "frequency_stride": 8, "time_stride": 8},
    "reformer": {"axial_pos_shape": [4, 4], "axial_pos_embds_dim": [32, 32],
                 "attn_layers": ["local", "local"], "local_attn_chunk_length": 8},
    "funnel": {"block_sizes": [1, 1], "num_decoder_layers": 1},
    "perceiver": {"num_latents": 8, "d_latents": 32},
    "big_bird": {"attention_type": "original_full"},
    "bigbird_pegasus": {"attention_type": "original_full"},
    "longformer": {"attention_window": 8},
    "led": {"attention_window": 8},
    "xlnet": {"mem_len": None},
    "levit": {"patch_size": 16, "hidden_sizes": [32, 48, 64], "num_attention_heads": [2, 3, 4],
              "down_ops": [["Subsample", 16, 2, 4, 2, 2], ["Subsample", 16, 3, 4, 2, 2]]},
    "gptj": {"rotary_dim": HEAD_DIM},
    "codegen": {"rotary_dim": HEAD_DIM},
    "mamba2": {"num_heads": 8, "n_groups": 1},  # heads x head dim = expand x hidden
    "zamba2": {"mamba_headdim": HEAD_DIM},
    "zamba": {"attention_hidden_size": 2 * HIDDEN, "attention_head_dim": 2 * HIDDEN // HEADS,
              "mamba_dt_rank": 4},
    "bit": {"num_groups": 4},
    "efficientnet": {"width_coefficient": 0.25, "depth_coefficient": 0.34, "hidden_dim": 320},
    "deepseek_v2": {"num_experts_per_tok": 2},  # None by default
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "esm": {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32},  # None by default
    "mobilebert": {"embedding_size": 32, "intra_bottleneck_size": 32, "true_hidden_size": 32},
    "squeezebert": {"embedding_size": HIDDEN},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {
        "rope_type": "default", "rope_theta": 10000.0}}},  # {} by default
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One model class to try: its family, model type and class name."""

    family: str
    model_type: str
    class_name: str


def entries() -> list[Entry]:
    """Every model type of :data:`FAMILIES` once (its first family wins), with that
    family's class for it.

    Model types that only alias another one's config (``gpt-sw3`` is GPT-2's config and
    class) are skipped.
    """
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    seen: set[str] = set()
    out: list[Entry] = []
    for family, mapping in FAMILIES.items():
        for model_type, names in getattr(modeling_auto, mapping).items():
            name = names[0] if isinstance(names, (list, tuple)) else names
            if model_type in seen or getattr(CONFIG_MAPPING[model_type], "model_type",
                                             model_type) != model_type:
                continue
            seen.add(model_type)
            out.append(Entry(family, model_type, name))
    return out


def _shrunk(cfg: Any, depth: int = 0) -> dict[str, Any]:
    """Overrides that make ``cfg`` tiny: generic fields, lists, dropout, sub-configs."""
    from transformers import PretrainedConfig

    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    # lists with one entry per layer are cut to LAYERS (not a vision model's per-stage lists)
    layers = None if "depths" in d else d.get("num_hidden_layers") or d.get("num_layers")
    out: dict[str, Any] = {}
    for key, value in d.items():
        if key in _SHRINK and isinstance(value, list) and value and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            if key in _PER_STAGE:  # one per stage of a hierarchical vision model
                out[key] = [_PER_STAGE[key](i) for i in range(len(value))]
        elif key in _SHRINK and (value is not None or key in ("use_cache",)):
            if isinstance(value, int) and not isinstance(value, bool) and \
                    isinstance(_SHRINK[key], int) and not isinstance(_SHRINK[key], bool):
                out[key] = min(value, _SHRINK[key]) if key not in ("num_labels",) else 5
            else:
                out[key] = _SHRINK[key]
        elif key in _LIST_SHRINK and isinstance(value, list) and value:
            out[key] = [_LIST_SHRINK[key] * (1 + i // 2) for i in range(len(value))] \
                if key != "conv_dim" else [_LIST_SHRINK[key]] * len(value)
        elif key in _LIST_ONES and isinstance(value, list) and value:
            out[key] = [1] * len(value)
        elif ("dropout" in key or "drop_prob" in key or key.endswith("_pdrop")
              or key in ("layerdrop", "drop_path_rate", "encoder_layerdrop",
                         "decoder_layerdrop", "hidden_dropout", "attention_dropout",
                         "mask_time_prob", "mask_feature_prob")) \
                and isinstance(value, float):
            out[key] = 0.0
        elif key in _TOKEN_IDS and isinstance(value, int) and value >= VOCAB // 2:
            out[key] = min(_TOKEN_IDS.index(key) + 1, VOCAB - 1)
        elif key == "layer_types" and isinstance(value, list):
            out[key] = value[:LAYERS]
        elif isinstance(value, list) and len(value) == layers > LAYERS:  # one per layer
            out[key] = value[:LAYERS]
        elif key == "per_layer_config" and isinstance(value, dict):  # {layer index: ...}
            out[key] = {k: v for k, v in value.items() if int(k) < LAYERS}
        elif isinstance(getattr(cfg, key, None), PretrainedConfig) and depth < 3:
            sub = getattr(cfg, key)
            out[key] = {**sub.to_dict(), **_shrunk(sub, depth + 1)}
    if "num_key_value_heads" in out and d.get("num_key_value_heads") == d.get(
            "num_attention_heads"):
        out["num_key_value_heads"] = out.get("num_attention_heads", HEADS)
    if "num_attention_heads" in out:  # None: derived in the model, from the full-size fields
        for key, value in (("head_dim", HEAD_DIM), ("num_key_value_heads", KV_HEADS)):
            if key in d and d[key] is None:
                out[key] = value
    if "mlp_ratio" in d and isinstance(d["mlp_ratio"], (int, float)):
        out["mlp_ratio"] = type(d["mlp_ratio"])(2)
    elif "mlp_ratio" in d and isinstance(d["mlp_ratio"], list):
        out["mlp_ratio"] = [type(r)(2) for r in d["mlp_ratio"]]
    return out


def tiny_config(model_type: str) -> Any:
    """The model type's config class, shrunk (:data:`_SHRINK`, :data:`OVERRIDES`)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    overrides = {**_shrunk(cls()), **OVERRIDES.get(model_type, {})}
    try:
        cfg = cls(**overrides)
    except Exception:  # a constructor that re-derives fields: set them afterwards instead
        cfg = cls()
        _set_fields(cfg, overrides)
    return cfg


def _set_fields(cfg: Any, fields: dict[str, Any]) -> None:
    """Set ``fields`` on ``cfg``; a dict for a sub-config is set field by field into it."""
    from transformers import PretrainedConfig

    for key, value in fields.items():
        sub = getattr(cfg, key, None)
        if isinstance(value, dict) and isinstance(sub, PretrainedConfig):
            _set_fields(sub, value)
        else:
            setattr(cfg, key, value)


def _config_for(cls: type, cfg: Any) -> Any:
    """The config ``cls`` takes: ``cfg``, or its sub-config of ``cls.config_class`` where the
    class takes one (``Qwen3_5ForCausalLM`` takes ``Qwen3_5Config.text_config``, Musicgen's
    causal LM its ``decoder``), already shrunk with ``cfg``."""
    want = getattr(cls, "config_class", None)
    if want is None or isinstance(cfg, want):
        return cfg
    for value in vars(cfg).values():
        if isinstance(value, want):
            return value
    return cfg


_CODEBOOK_ROWS = ("musicgen_decoder", "musicgen_melody_decoder")
"""Config types whose ``input_ids`` hold one row per (sample, codebook)."""


def _no_dropout(model: nn.Module) -> None:
    for mod in model.modules():
        if isinstance(mod, nn.modules.dropout._DropoutNd):
            mod.p = 0.0
        for attr in ("drop_prob", "layerdrop", "dropout_prob"):
            if isinstance(getattr(mod, attr, None), float):
                setattr(mod, attr, 0.0)


def _logits(out: Any) -> torch.Tensor:
    """The tensor a loss is taken over: ``.logits`` or the first tensor output."""
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, torch.Tensor):
        return out
    for value in (out.values() if hasattr(out, "values") else out):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    raise TypeError(f"no tensor output in {type(out).__name__}")


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits ``(..., classes)`` against ``target`` ``(...)``, float32."""
    logits = _logits(out)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                       target.reshape(-1))


def _inputs(model: nn.Module, cfg: Any, family: str) -> dict[str, torch.Tensor]:
    """Random inputs for the model's main input, batch :data:`BATCH`."""
    gen = torch.Generator().manual_seed(1)
    name = getattr(model, "main_input_name", "input_ids")
    vocab = int(getattr(cfg, "vocab_size", None) or getattr(
        getattr(cfg, "text_config", None), "vocab_size", None) or VOCAB)
    lo = 3 if vocab > 8 else 0  # keep clear of pad / bos / eos ids
    kw: dict[str, torch.Tensor] = {}
    if name == "input_ids":
        # a decoder over audio codebooks (Musicgen) takes one row per (sample, codebook)
        rows = BATCH * (cfg.num_codebooks if cfg.model_type in _CODEBOOK_ROWS else 1)
        kw["input_ids"] = torch.randint(lo, vocab, (rows, SEQ), generator=gen)
    elif name == "pixel_values":
        size = getattr(cfg, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(cfg, "num_channels", 3)
        kw["pixel_values"] = torch.randn(BATCH, channels, size, size, generator=gen)
    elif name == "input_values" and hasattr(cfg, "max_length") and hasattr(cfg, "num_mel_bins"):
        kw["input_values"] = torch.randn(BATCH, cfg.max_length, cfg.num_mel_bins, generator=gen)
    elif name == "input_values":  # raw audio
        kw["input_values"] = torch.randn(BATCH, 4000, generator=gen)
    elif name == "input_features":
        if cfg.model_type == "whisper":
            shape = (BATCH, cfg.num_mel_bins, 2 * cfg.max_source_positions)
        elif hasattr(cfg, "max_length") and hasattr(cfg, "num_mel_bins"):  # AST
            shape = (BATCH, cfg.max_length, cfg.num_mel_bins)
        elif hasattr(cfg, "input_feat_per_channel"):
            shape = (BATCH, 32, cfg.input_feat_per_channel * getattr(cfg, "input_channels", 1))
        else:
            mel = getattr(cfg, "num_mel_bins", None) or getattr(cfg, "feature_size", 80)
            shape = (BATCH, 32, mel)
        kw["input_features"] = torch.randn(*shape, generator=gen)
    else:
        raise TypeError(f"no input recipe for main input {name!r}")
    if family in ("seq2seq_lm", "speech_seq2seq"):
        dec_vocab = int(getattr(cfg, "decoder_vocab_size", None) or vocab)
        kw["decoder_input_ids"] = torch.randint(lo, dec_vocab, (BATCH, SEQ // 2), generator=gen)
    return kw


@dataclasses.dataclass
class Built:
    """A tiny model ready to run: ``model(**kwargs)``; ``loss_fn(output, target)``."""

    model: nn.Module
    kwargs: dict[str, torch.Tensor]
    target: torch.Tensor
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    num_params: int


def build(entry: Entry) -> Built:
    """Build ``entry``'s tiny model with random weights (seed 0), dropout off, train mode.

    The target is random classes shaped like the logits less their last dimension, found
    by one eager forward.

    Raises:
        Exception: whatever transformers raises for a config or input it refuses.
    """
    import transformers

    cls = getattr(transformers, entry.class_name)
    cfg = _config_for(cls, tiny_config(entry.model_type))
    torch.manual_seed(0)
    model = cls(cfg).float()
    _no_dropout(model)
    model.train()
    kwargs = _inputs(model, model.config, entry.family)
    with torch.no_grad():
        logits = _logits(model(**kwargs))
    gen = torch.Generator().manual_seed(2)
    target = torch.randint(0, logits.shape[-1], tuple(logits.shape[:-1]), generator=gen)
    return Built(model, kwargs, target, loss_fn, sum(p.numel() for p in model.parameters()))


def iter_entries(only: list[str] | None = None) -> Iterator[Entry]:
    """:func:`entries`, restricted to model types or class names in ``only`` when given."""
    for e in entries():
        if not only or e.model_type in only or e.class_name in only:
            yield e
