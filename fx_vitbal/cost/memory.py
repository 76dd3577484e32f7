"""Activation memory of a ViT, per patch: what a rank holds for the backward while it computes a
frame (or a band of one), from the tower's dimensions. Pure arithmetic, like the cost models.

[Note: held activations] Per layer and patch, a pre-norm transformer block without activation
checkpointing keeps for its backward (Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models", 2022, section 4.1, without dropout masks; flash or SDPA attention,
which keeps its output and a logsumexp instead of the ``N x N`` scores):

- ``HIDDEN_VALUES`` (8) values of width ``hidden``: the input of each of the two norms, the
  input of the q/k/v projection, q, k and v, and the attention output (the input of the output
  projection), and the input of the MLP's first matrix;
- ``MLP_VALUES`` (2; ``GATED_MLP_VALUES``, 4, for a gated MLP) values of width ``mlp_hidden``:
  the MLP's hidden before and after its activation (gated: both branches, the activation and
  their product).

In bf16 (2 bytes a value), ``2 * (8 * hidden + 2 * mlp_hidden)`` bytes a layer, ``32 * d`` for
an MLP-4x tower of width ``d``. ``../shared/notes/bands.md`` quotes about ``25 * N * d`` bytes a
layer for ``N`` patches of such a tower, and torchtitan's measured 57.6 GB for one 82,944-patch
image through 27 layers of width 1024 is ``25.1 * N * d`` a layer: this count is 1.28x that,
on the safe side for a budget (a frame it says does not fit may have fit; not the reverse).

A band of ``n`` of its frame's ``N`` patches holds ``n / N`` of the frame's activations whatever
its exchange: each exchange kind keeps only the band's own rows for the backward (the runtime
fetches the other bands' keys and values again in the backward: ``runtime/bands/``,
[Note: what autograd keeps]).
"""

from fx_vitbal.cost.static import ArchitectureCost

BYTES_PER_VALUE = 2  # bf16, what training runs in
HIDDEN_VALUES = 8
MLP_VALUES = 2
GATED_MLP_VALUES = 4
MLP_RATIO = 4  # the MLP width assumed where only the attention width is known


def held_bytes_per_patch(architecture: ArchitectureCost) -> int:
    """Bytes of activations one patch keeps for the backward through the whole tower
    (``architecture.depth`` layers; see [Note: held activations]).

    Args:
        architecture: the tower's dimensions.

    Returns:
        ``2 * depth * (8 * hidden + c * mlp_hidden)`` with ``c`` 2 (4 for a gated MLP).
    """
    mlp = GATED_MLP_VALUES if architecture.gated_mlp else MLP_VALUES
    per_layer = HIDDEN_VALUES * architecture.hidden + mlp * architecture.mlp_hidden
    return BYTES_PER_VALUE * architecture.depth * per_layer


def held_bytes_per_patch_of_width(width: int, layers: int) -> int:
    """``held_bytes_per_patch`` of a tower known only by its attention width and layers: an
    MLP ``MLP_RATIO`` (4) times as wide, not gated."""
    per_layer = HIDDEN_VALUES * width + MLP_VALUES * MLP_RATIO * width
    return BYTES_PER_VALUE * layers * per_layer
