"""Qwen4-Exp: a hybrid MoE text model with hyper-connections and indexed (sparse) attention;
Qwen-style layout, one ``<vs> pads <ve>`` group per video frame."""

import transformers

from hf_zoo._common import qwen_style_batch
from hf_zoo.qwen3_5 import MOE, build_variant


def build():
    return build_variant(
        transformers.Qwen4ExpConfig,
        transformers.Qwen4ExpForConditionalGeneration,
        "indexed_attention",
        **MOE,
        hc_count=2,  # hyper-connections need at least 2 streams
        hc_lowrank=8,
        # indexed_attention, the only full-attention type, needs the indexer's fields
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=16,
        indexer_compress_ratio=4,
    )


def batch(model, images, videos, seed):
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=True)
