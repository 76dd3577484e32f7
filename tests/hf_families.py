"""The outcome balancing gives each Hugging Face VLM family whose modeling code uses
``grid_thw`` (transformers' ``model_type``): exact on 2 ranks, or refused when wrapped, and why.
``test_hf_families.py`` checks every entry the installed transformers has, and docs/design.md
shows this table (every entry, whichever transformers is installed)."""

import dataclasses

import packaging.version

from fx_vitbal.integrations.hf_towers import REFUSED_PARENTS, REFUSED_TOWERS


@dataclasses.dataclass(frozen=True)
class Exact:
    """Balanced exactly: logits and gradients equal the unbalanced run's."""

    videos: bool = True
    """The family takes videos (the test feeds it one)."""
    bands: bool = False
    """Its tower runs row bands of a frame (a split rule): the test splits one too."""
    since: str = ""
    """The first transformers release with the family, where newer than the pinned one."""


@dataclasses.dataclass(frozen=True)
class Refused:
    """``enable_vit_balance`` raises a ``TypeError`` naming this class (the family's tower, or
    the model around it) and the library's reason (``REFUSED_TOWERS`` / ``REFUSED_PARENTS``)."""

    cls: str
    since: str = ""
    """The first transformers release with the family, where newer than the pinned one."""

    @property
    def reason(self) -> str:
        return {**REFUSED_TOWERS, **REFUSED_PARENTS}[self.cls]


FAMILIES = {
    "cohere_compass": Exact(bands=True),
    "cosmos3_edge": Exact(),
    "dots3_note": Exact(),
    "ernie4_5_vl_moe": Exact(),
    "exaone4_5": Exact(bands=True),
    "glm5_next": Exact(),
    "lfm3_vl": Exact(),
    "minimax_m3_vl": Exact(),
    "muse_glimmer": Exact(),
    "muse_spark": Exact(),
    "paddleocr_vl": Exact(videos=False),
    "cosmos3_omni": Exact(bands=True),
    "glm46v": Exact(bands=True),
    "glm4v": Exact(bands=True),
    "glm4v_moe": Exact(bands=True),
    "glm_ocr": Exact(),
    "hyperclovax_vision_v2": Exact(bands=True),
    "qwen2_5_omni": Exact(bands=True),
    "qwen2_5_vl": Exact(bands=True),
    "qwen2_vl": Exact(bands=True),
    "qwen3_5": Exact(bands=True),
    "qwen3_5_moe": Exact(bands=True),
    "qwen3_omni_moe": Exact(bands=True),
    "qwen3_vl": Exact(bands=True),
    "qwen3_vl_moe": Exact(bands=True),
    "qwen4_exp": Exact(bands=True),
    "llava_onevision1_5": Exact(since="5.25.0"),
    "ovis2_5": Exact(since="5.25.0"),
    "colqwen2": Refused("ColQwen2ForRetrieval"),
    "glm_image": Refused("GlmImageVisionModel"),
    "hunyuan_vl": Exact(videos=False),
    "hy_v4_vl": Exact(),
    "inkling2": Exact(videos=False),
    "inkling2_loop": Exact(videos=False),
    "kimi_k25": Exact(),
    "minicpm_ocr": Exact(),
    "minicpmv4_6": Exact(),
    "minicpmv4_7": Exact(),
    "step3p7": Refused("Step3p7VisionModel"),
    "video_llama_3": Refused("VideoLlama3VisionModel"),
}


def installed(version: str) -> dict:
    """The entries of the families transformers ``version`` has."""
    have = packaging.version.Version(version)
    return {
        name: entry
        for name, entry in FAMILIES.items()
        if not entry.since or packaging.version.Version(entry.since) <= have
    }


def markdown_table() -> str:
    """The table docs/design.md shows (``test_hf_families`` checks it is there)."""
    rows = ["| model type | outcome | why |", "|---|---|---|"]
    for name, entry in sorted(FAMILIES.items()):
        name = f"`{name}`" + (f" ({entry.since})" if entry.since else "")
        if isinstance(entry, Exact):
            outcome = "exact" if entry.videos else "exact (takes no videos)"
            outcome += ", bands" if entry.bands else ""
            rows.append(f"| {name} | {outcome} | |")
        else:
            rows.append(f"| {name} | refused | `{entry.cls}`: {entry.reason} |")
    return "\n".join(rows) + "\n"


def counts() -> str:
    """The README's count of exact families (of the newest transformers the table knows)."""
    exact = sum(isinstance(entry, Exact) for entry in FAMILIES.values())
    return f"{exact} of the {len(FAMILIES)} model types"
