"""Synthetic but realistic image/video mixes, shared by the demo, the simulator and benchmarks.

Grids are ``[t, h, w]`` in 14-pixel patches with ``h`` and ``w`` even (a 2x2 merge must divide
them), as a Qwen2-VL processor produces after smart resizing.
"""

import random

# (name, probability, t range, h range, w range) in patches. Sources of the ranges:
# thumbnails 224-448 px; photos 448-1344 px; documents 1.5-2.8k px scans (the Qwen2-VL processor's
# max_pixels ~ 12.8M px caps them near 16k patches); videos 2-16 sampled frame pairs of 224-448 px.
MIXES: dict[str, list[tuple[str, float, tuple[int, int], tuple[int, int], tuple[int, int]]]] = {
    "realistic": [
        ("thumbnail", 0.30, (1, 1), (8, 32), (8, 32)),
        ("photo", 0.45, (1, 1), (32, 96), (32, 96)),
        ("document", 0.10, (1, 1), (96, 144), (64, 112)),
        ("video", 0.15, (2, 16), (16, 32), (16, 32)),
    ],
    "photos": [("photo", 1.0, (1, 1), (32, 96), (32, 96))],
    "documents": [
        ("thumbnail", 0.6, (1, 1), (8, 32), (8, 32)),
        ("document", 0.4, (1, 1), (96, 144), (64, 112)),
    ],
}


def sample_grid(rng: random.Random, mix: str = "realistic") -> list[int]:
    """One ``[t, h, w]`` grid drawn from ``MIXES[mix]``."""
    kinds = MIXES[mix]
    _, _, t_range, h_range, w_range = rng.choices(kinds, weights=[k[1] for k in kinds])[0]
    t = rng.randint(*t_range)
    h = 2 * rng.randint(h_range[0] // 2, h_range[1] // 2)
    w = 2 * rng.randint(w_range[0] // 2, w_range[1] // 2)
    return [t, h, w]


def sample_batches(
    num_ranks: int, images_per_rank: int, *, mix: str = "realistic", seed: int = 0
) -> list[list[list[int]]]:
    """Per-rank grid lists; each rank holds between 0 and ``2 * images_per_rank`` images, so the
    mean is ``images_per_rank`` and counts vary like packed VLM samples do."""
    rng = random.Random(seed)
    return [
        [sample_grid(rng, mix) for _ in range(rng.randint(0, 2 * images_per_rank))]
        for _ in range(num_ranks)
    ]
