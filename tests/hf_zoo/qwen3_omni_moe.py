"""Qwen3-Omni-MoE's Thinker, the smallest class that generates text and calls the tower (a tiny
audio tower is built too, unused). Batches in the Omni layout: media found by token ids."""

import transformers

from hf_zoo._common import IMAGE, TEXT, VEND, VIDEO, VISION, VSTART, instantiate, mrope, omni_batch


def build():
    config = transformers.Qwen3OmniMoeThinkerConfig(
        vision_config=dict(VISION, num_position_embeddings=144, deepstack_visual_indexes=[0, 1]),
        audio_config=dict(
            num_mel_bins=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=64,
            d_model=32,
            output_dim=64,
            n_window=4,
            max_source_positions=64,
            downsample_hidden_size=16,
            n_window_infer=8,
            conv_chunksize=8,
        ),
        text_config=dict(
            TEXT,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            rope_parameters=mrope(),
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        audio_token_id=124,
        audio_start_token_id=125,
        audio_end_token_id=126,
        vision_start_token_id=VSTART,  # read by get_rope_index, not declared fields
        vision_end_token_id=VEND,
    )
    return instantiate(transformers.Qwen3OmniMoeThinkerForConditionalGeneration, config)


batch = omni_batch
