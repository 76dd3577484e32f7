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
    "hyperclovax_vision_v2": Exact(),
}
