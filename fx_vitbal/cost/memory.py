"""Activation memory of a ViT, per patch: what a rank holds for the backward while it computes a
frame (or a band of one), from the tower's dimensions. Pure arithmetic, like the cost models.

[Note: held activations] Per layer and patch, a pre-norm transformer block without activation
checkpointing keeps for its backward, as the Hugging Face towers keep it (measured in
``test_band_planning.py``: the storages autograd saves, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4V
with SDPA attention; flash or SDPA attention keeps its output and a logsumexp instead of the
``N x N`` scores):

- ``HIDDEN_VALUES`` (14) values of width ``hidden``: the input of each of the two norms and, for
  an RMSNorm, each normalised copy the weight multiplies; the input of the q/k/v projection and
  its whole output (the attention keeps v, a view of it); q and k after the rotary embedding;
  the attention's output and the copy of it the output projection takes; the input of the MLP's
  first matrix (11 for a LayerNorm tower, 13 for an RMSNorm one); and one more for the norms'
  statistics and the attention's logsumexp (a few values a patch);
- ``MLP_VALUES`` (3; ``GATED_MLP_VALUES``, 4, for a gated MLP) values of width ``mlp_hidden``:
  the MLP's hidden before its activation, what the activation keeps and its output (Qwen2-VL's
  QuickGELU, ``x * sigmoid(1.702 x)``, keeps all three; a fused GELU two; gated: both branches,
  the activation's output and their product).

In bf16 (2 bytes a value), ``2 * (14 * hidden + 3 * mlp_hidden)`` bytes a layer, ``52 * d`` for
an MLP-4x tower of width ``d``: over the towers above, 1.04-1.32x what they keep (safe for a
budget: a frame it says does not fit may have fit; not the reverse). An earlier count (8 and 2,
``32 * d``) was 1.26-1.43x below them. A leaner tower keeps less: ``../shared/notes/bands.md``
quotes about ``25 * N * d`` bytes a layer, and torchtitan measured 57.6 GB for one 82,944-patch
image through 27 layers of width 1024, ``25.1 * N * d`` a layer.

A band of ``n`` of its frame's ``N`` patches holds ``n / N`` of the frame's activations whatever
its exchange: each exchange kind keeps only the band's own rows for the backward (the runtime
fetches the other bands' keys and values again in the backward: ``runtime/bands/``,
[Note: what autograd keeps]).
"""

import math

from fx_vitbal.cost.static import ArchitectureCost

BYTES_PER_VALUE = 2  # bf16, what training runs in
HIDDEN_VALUES = 14
MLP_VALUES = 3
GATED_MLP_VALUES = 4
MLP_RATIO = 4  # the MLP width assumed where only the attention width is known


def held_bytes_per_patch(architecture: ArchitectureCost) -> int:
    """Bytes of activations one patch keeps for the backward through the whole tower
    (``architecture.depth`` layers; see [Note: held activations]).

    Args:
        architecture: the tower's dimensions.

    Returns:
        ``2 * depth * (14 * hidden + c * mlp_hidden)`` with ``c`` 3 (4 for a gated MLP).
    """
    mlp = GATED_MLP_VALUES if architecture.gated_mlp else MLP_VALUES
    per_layer = HIDDEN_VALUES * architecture.hidden + mlp * architecture.mlp_hidden
    return BYTES_PER_VALUE * architecture.depth * per_layer


def held_bytes_per_patch_of_width(width: int, layers: int) -> int:
    """``held_bytes_per_patch`` of a tower known only by its attention width and layers: an
    MLP ``MLP_RATIO`` (4) times as wide, not gated."""
    per_layer = HIDDEN_VALUES * width + MLP_VALUES * MLP_RATIO * width
    return BYTES_PER_VALUE * layers * per_layer


def rows_within(budget: int | None, held_per_patch: int) -> float:
    """The most patches (pixel rows) whose activations fit in ``budget`` bytes at
    ``held_per_patch`` bytes each; ``math.inf`` without a budget or a count of held bytes."""
    return math.inf if budget is None or not held_per_patch else budget // held_per_patch
