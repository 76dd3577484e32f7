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
}
