"""Muse-Glimmer: a pixel-shuffle tower with window then full attention over a 4x4 learned
position grid, 1-D text positions; Muse layout (per-frame video pads between separators)."""

import transformers

from hf_zoo._common import IMAGE, TEXT, VIDEO, instantiate, muse_batch


def build():
    return build_variant(
        transformers.MuseGlimmerConfig, transformers.MuseGlimmerForConditionalGeneration
    )


def build_variant(config_cls, model_cls, **text):
    """A Muse-line model: the tiny pixel-shuffle tower, with ``text`` added to the text model (and
    any other top-level fields among them)."""
    audio = text.pop("audio_config", None)
    config = config_cls(
        vision_config=dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            patch_size=14,
            patch_temporal=2,
            merge_size=2,
            # windows are pos_emb_height patches high: an 8x12 grid gets 2x3 windows
            pos_emb_height=4,
            pos_emb_width=4,
            max_position_embeddings=16,
            layer_types=["window_attention", "full_attention"],
        ),
        text_config=dict(
            TEXT, hidden_size=96, bos_token_id=1, eos_token_id=2, sliding_window=64, **text
        ),
        **({"audio_config": audio} if audio is not None else {}),
        out_hidden_size=64 * 4,  # the tower's out width: hidden * merge^2 after pixel_shuffle
        projector_hidden_size=128,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
    )
    return instantiate(model_cls, config)


batch = muse_batch
