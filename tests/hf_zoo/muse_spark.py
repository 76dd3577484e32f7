"""Muse-Spark: Muse-Glimmer's tower with an MoE text model (and an unused audio tower); Muse
layout (per-frame video pads between separators)."""

import transformers

from hf_zoo._common import muse_batch
from hf_zoo.muse_glimmer import build_variant


def build():
    return build_variant(
        transformers.MuseSparkConfig,
        transformers.MuseSparkForConditionalGeneration,
        mlp_layer_types=["dense", "sparse"],
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_hidden_size=48,
        audio_config=dict(  # built, unused; its out width must equal the text width
            patch_sizes=[2, 2],
            hidden_sizes=[16, 32],
            depths=[1, 1],
            num_hidden_layers=2,
            out_hidden_size=96,
        ),
    )


batch = muse_batch
