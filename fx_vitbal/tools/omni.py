"""Reference parent: a tiny VLM (``OmniEncoderModel``) around ``models.QwenStyleViT``.

``OmniEncoderModel`` is the parent: it calls ``self.visual`` once as a plain module call (the
balancer intercepts that call or swaps the module), un-permutes windows, merges pre-merger rows
with its ``projector``, scatters the image embeddings into the image placeholder tokens and adds
deepstack features after the first LM blocks. Its forward is traceable
by ``torch.fx`` with the tower as a leaf, and by dynamo without windows.
"""

import dataclasses

import torch
from torch import Tensor, nn

from fx_vitbal.tools.attention import masked_attention
from fx_vitbal.tools.models import Merger, PreNormBlock, QwenStyleViT, ViTConfig, gather_blocks

__all__ = ["LMConfig", "OmniEncoderModel", "make_inputs"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMConfig:
    """Shape of the tiny decoder LM in ``OmniEncoderModel``; ``hidden`` must equal the ViT's
    ``out_dim``, and ``image_token_id`` marks the placeholder tokens that receive image rows."""

    vocab_size: int = 64
    hidden: int = 32
    num_layers: int = 2
    num_heads: int = 4
    image_token_id: int = 3

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers!r}")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})"
            )
        if not 0 <= self.image_token_id < self.vocab_size:
            raise ValueError(
                f"image_token_id must be in [0, {self.vocab_size}), got {self.image_token_id!r}"
            )


class _DecoderBlock(PreNormBlock):
    def __init__(self, config: LMConfig) -> None:
        super().__init__(config.hidden, config.num_heads, 4 * config.hidden)

    def forward(self, x: Tensor) -> Tensor:
        # Static unflatten sizes only, so torch.fx never has to trace a shape.
        qkv = self.qkv(self.norm1(x)).unflatten(-1, (3, self.num_heads, -1)).transpose(0, 2)
        q, k, v = qkv.unbind(1)
        causal = q.new_ones((q.shape[1], q.shape[1]), dtype=torch.bool).tril()
        out = masked_attention(q, k, v, causal)
        x = x + self.proj(out.transpose(0, 1).flatten(1))
        return x + self.mlp(self.norm2(x))


class OmniEncoderModel(nn.Module):
    """A tiny VLM: ``QwenStyleViT`` at ``self.visual`` feeding a small causal decoder LM.

    ``forward(input_ids [L], pixel_values, image_grid_thw)`` takes one packed sequence without a
    batch dim and returns logits ``[L, vocab_size]``. ``input_ids`` must hold exactly
    ``N / m**2`` ``image_token_id`` tokens, which receive the image rows in order.
    """

    def __init__(self, vit_config: ViTConfig, lm_config: LMConfig) -> None:
        super().__init__()
        if lm_config.hidden != vit_config.out_dim:
            raise ValueError(
                f"lm_config.hidden ({lm_config.hidden}) must equal "
                f"vit_config.out_dim ({vit_config.out_dim})"
            )
        self.vit_config = vit_config
        self.lm_config = lm_config
        # The attribute name matters: the balancer finds the tower as `visual`.
        self.visual = QwenStyleViT(vit_config)
        if not vit_config.merged_output:  # the tower returns pre-merger rows: merge them here
            self.projector = Merger(
                vit_config.hidden, vit_config.spatial_merge_size, lm_config.hidden
            )
        self.embed = nn.Embedding(lm_config.vocab_size, lm_config.hidden)
        self.layers = nn.ModuleList(_DecoderBlock(lm_config) for _ in range(lm_config.num_layers))
        self.norm = nn.LayerNorm(lm_config.hidden)
        self.lm_head = nn.Linear(lm_config.hidden, lm_config.vocab_size)

    def encode_images(
        self, pixel_values: Tensor, image_grid_thw: Tensor
    ) -> tuple[Tensor, list[Tensor]]:
        """Image embeddings and deepstack features, in input order, ``[N / m**2, hidden]`` each."""
        # One plain module call: this is the call site the balancer intercepts.
        vis = self.visual(pixel_values, image_grid_thw)
        # Index the tuple instead of unpacking, and take sizes from the static config, so that
        # torch.fx can trace this with the tower as a leaf (its output is then one Proxy).
        config = self.vit_config
        embeds = vis[0]
        deepstack = [vis[2][k] for k in range(len(config.deepstack_indexes))]
        if config.window_size is not None:
            reverse = torch.argsort(vis[1])
            m = 1 if config.merged_output else config.spatial_merge_size
            embeds = gather_blocks(embeds, reverse, m)
            deepstack = [d[reverse] for d in deepstack]
        if not config.merged_output:
            embeds = self.projector(embeds)
        return embeds, deepstack

    def forward(self, input_ids: Tensor, pixel_values: Tensor, image_grid_thw: Tensor) -> Tensor:
        """Logits ``[L, vocab_size]`` for one packed sequence."""
        embeds, deepstack = self.encode_images(pixel_values, image_grid_thw)
        mask = (input_ids == self.lm_config.image_token_id)[:, None]
        h = self.embed(input_ids)
        # Under autocast the tower's rows come out in bf16 while embeddings stay fp32 (HF's
        # parents cast the same way).
        h = h.masked_scatter(mask, embeds.to(h.dtype))
        for k, layer in enumerate(self.layers):
            h = layer(h)
            if k < len(deepstack):
                # Qwen3-VL deepstack: add features at the image positions. Scattering into zeros
                # keeps every shape static (no h[mask]), which dynamo needs for fullgraph.
                h = h + torch.zeros_like(h).masked_scatter(mask, deepstack[k].to(h.dtype))
        return self.lm_head(self.norm(h))


def make_inputs(
    grids: list[list[int]],
    *,
    in_dim: int,
    text_per_image: int = 3,
    image_token_id: int = 3,
    vocab_size: int = 64,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    spatial_merge_size: int = 2,
) -> tuple[Tensor, Tensor, Tensor]:
    """Random ``(input_ids, pixel_values, image_grid_thw)`` for the grids ``[[t, h, w], ...]``.

    Each image gets ``text_per_image`` random text tokens (never ``image_token_id``) followed by
    its ``t*h*w / m**2`` image tokens; with no grids the sequence is ``text_per_image`` text
    tokens. Deterministic in ``seed`` without touching the global RNG.
    """
    m = spatial_merge_size
    for grid in grids:
        t, h, w = grid
        if t < 1 or h < 1 or w < 1 or h % m or w % m:
            raise ValueError(f"grid must be positive with h, w multiples of {m}, got {grid!r}")
    gen = torch.Generator().manual_seed(seed)
    grid_thw = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    num_patches = int(grid_thw.prod(1).sum())
    pixel_values = torch.randn(num_patches, in_dim, generator=gen, dtype=dtype)

    def text(n: int) -> Tensor:
        # Draw from the vocab minus one id, then shift past image_token_id to skip it.
        ids = torch.randint(0, vocab_size - 1, (n,), generator=gen)
        return ids + (ids >= image_token_id).long()

    parts = [text(text_per_image)] if not grids else []
    for t, h, w in grids:
        parts.append(text(text_per_image))
        parts.append(torch.full((t * h * w // (m * m),), image_token_id, dtype=torch.long))
    return torch.cat(parts), pixel_values, grid_thw
