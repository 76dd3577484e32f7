"""The outcome balancing gives each Hugging Face VLM family whose modeling code uses
``grid_thw`` (transformers' ``model_type``): exact on 2 ranks, or refused when wrapped, and why.
``test_hf_families.py`` checks every entry, and docs/design.md shows this table."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Exact:
    """Balanced exactly: logits and gradients equal the unbalanced run's."""

    videos: bool = True
    """The family takes videos (the test feeds it one)."""


@dataclasses.dataclass(frozen=True)
class Refused:
    """``enable_vit_balance`` raises, its message matching ``match``; ``why`` for the docs."""

    match: str
    why: str


FAMILIES = {
    "cohere_compass": Exact(),
    "cosmos3_edge": Exact(),
    "dots3_note": Exact(),
    "ernie4_5_vl_moe": Exact(),
    "exaone4_5": Exact(),
    "glm5_next": Exact(),
    "lfm3_vl": Exact(),
    "minimax_m3_vl": Exact(),
    "muse_glimmer": Exact(),
    "muse_spark": Exact(),
    "paddleocr_vl": Exact(videos=False),
    "cosmos3_omni": Exact(),
    "glm46v": Exact(),
    "glm4v": Exact(),
    "glm4v_moe": Exact(),
    "glm_ocr": Exact(),
    "hyperclovax_vision_v2": Exact(),
    "qwen2_5_omni": Exact(),
    "qwen2_5_vl": Exact(),
    "qwen2_vl": Exact(),
    "qwen3_5": Exact(),
    "qwen3_5_moe": Exact(),
    "qwen3_omni_moe": Exact(),
    "qwen3_vl": Exact(),
    "qwen3_vl_moe": Exact(),
    "qwen4_exp": Exact(),
    "colqwen2": Refused("ColQwen2ForRetrieval cannot be balanced", "calls the tower itself"),
    "glm_image": Refused("GlmImageVisionModel cannot be balanced", "image generation, VQ codes"),
    "hunyuan_vl": Refused("HunYuanVLVisionTransformer cannot", "line and begin/end rows"),
    "hy_v4_vl": Refused("HYV4VLVisionModel cannot be balanced", "a row per line of patches"),
    "inkling2": Refused("Inkling2VisionModel cannot be balanced", "grid in LM tokens, CLS rows"),
    "inkling2_loop": Refused("Inkling2VisionModel cannot be balanced", "Inkling2's tower"),
    "kimi_k25": Refused("Kimi_K25VisionModel cannot be balanced", "frames attend and average"),
    "minicpm_ocr": Refused("MiniCPMOcrVisionModel cannot be balanced", "no grid_thw"),
    "minicpmv4_6": Refused("MiniCPMV4_6VisionModel cannot be balanced", "no grid_thw"),
    "minicpmv4_7": Refused("MiniCPMV4_7VisionModel cannot be balanced", "no grid_thw"),
    "step3p7": Refused("Step3p7VisionModel cannot be balanced", "no grid, two calls a step"),
    "video_llama_3": Refused("VideoLlama3VisionModel cannot be balanced", "merge size per row"),
}
