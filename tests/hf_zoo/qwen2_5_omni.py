"""Qwen2.5-Omni's Thinker, the smallest class that generates text and calls the tower (a tiny
audio tower is built too, unused). Batches in the Omni layout: media found by token ids."""

import transformers

from hf_zoo._common import IMAGE, TEXT, VEND, VIDEO, VISION, VSTART, instantiate, mrope, omni_batch


def build():
    config = transformers.Qwen2_5OmniThinkerConfig(
        vision_config=dict(VISION, fullatt_block_indexes=[1], window_size=112),
        audio_config=dict(
            num_mel_bins=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=64,
            d_model=32,
            output_dim=64,
            n_window=4,
            max_source_positions=64,
        ),
        text_config=dict(TEXT, rope_parameters=mrope()),
        image_token_index=IMAGE,
        video_token_index=VIDEO,
        audio_token_index=124,
        audio_start_token_id=125,
        audio_end_token_id=126,
        vision_start_token_id=VSTART,  # read by get_rope_index, not declared fields
        vision_end_token_id=VEND,
    )
    return instantiate(transformers.Qwen2_5OmniThinkerForConditionalGeneration, config)


batch = omni_batch
