"""Reference model: a tiny Qwen-style vision tower written to the ViT contract.

fx_vitbal moves whole images (or video frames) between data-parallel ranks before the ViT runs and
moves the results back afterwards. That is only exact if the tower has the properties of the real
grid_thw towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), so this stand-in reproduces them on purpose:

- Rows of ``pixel_values`` are patches; image ``i`` with grid row ``[t, h, w]`` owns ``t*h*w``
  consecutive rows, frame-major, each frame in merge-block order (``(h/m, w/m, m, m)`` flattened).
- Attention never crosses a frame (Qwen2-VL ``cu_seqlens``), or with ``window_size`` set, never
  crosses a window (Qwen2.5-VL). Hence every image's outputs depend only on that image, and a video
  ``[t, h, w]`` gives exactly the outputs of ``t`` rows ``[1, h, w]``.
- With windows the tower returns its output in window order plus ``window_index``, like Megatron's
  Qwen2.5-VL ViT; the parent un-permutes. Qwen3-VL deepstack outputs come back as a list.
- By default (LoongForge's layout) the tower returns its last block's output **before** the
  patch merger, ``t*h*w`` rows per image, and deepstack features already merged, ``t*h*w / m**2``
  rows; the parent un-permutes and merges/projects after the balancer has moved rows home. With
  ``ViTConfig(merged_output=True)`` the tower merges itself (Hugging Face's ``pooler_output``).

The tower has two attention paths with the same math (``fx_vitbal.tools.attention``): eagerly
one ``scaled_dot_product_attention`` per segment, under ``torch.compile`` one dense attention
under a block-diagonal mask, so the no-window tower traces with ``fullgraph=True`` even when the
row count is an unbacked size. It runs row bands of a frame split across ranks
(``BandSupport``), in their tensor form when compiled.

The parent VLM around it is ``fx_vitbal.tools.omni``.
"""

import dataclasses

import torch
from torch import Tensor, nn

from fx_vitbal.cost.static import ArchitectureCost
from fx_vitbal.runtime.vit.registry import BandSupport, register_vision_encoder
from fx_vitbal.tools.attention import Segments, attend, segments_of

__all__ = ["QwenStyleViT", "ViTConfig"]


def _check_indexes(name: str, indexes: tuple[int, ...], depth: int) -> None:
    if list(indexes) != sorted(set(indexes)) or any(not 0 <= i < depth for i in indexes):
        raise ValueError(
            f"{name} must be strictly increasing block indexes in [0, {depth}), got {indexes!r}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ViTConfig:
    """Shape of a ``QwenStyleViT``; the defaults give a tower small enough for unit tests.

    ``window_size`` is the window side in merged tokens (Qwen2.5-VL: 112 / 14 / 2 = 4); ``None``
    means every block attends per frame. ``fullatt_block_indexes`` lists the blocks that still
    attend per frame when windows are on. ``deepstack_indexes`` lists the blocks whose output
    feeds its own merger (Qwen3-VL deepstack). ``merged_output`` moves the final patch merger
    into the tower (its first output then has ``t*h*w / m**2`` rows, not ``t*h*w``).
    """

    in_dim: int = 24
    hidden: int = 32
    num_heads: int = 4
    depth: int = 2
    mlp_hidden: int = 64
    out_dim: int = 32
    spatial_merge_size: int = 2
    window_size: int | None = None
    fullatt_block_indexes: tuple[int, ...] = ()
    deepstack_indexes: tuple[int, ...] = ()
    merged_output: bool = False

    def __post_init__(self) -> None:
        # A list would make the frozen config unhashable and let callers mutate it later.
        object.__setattr__(self, "fullatt_block_indexes", tuple(self.fullatt_block_indexes))
        object.__setattr__(self, "deepstack_indexes", tuple(self.deepstack_indexes))
        for name in ("in_dim", "hidden", "num_heads", "depth", "mlp_hidden", "out_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.spatial_merge_size < 1:
            raise ValueError(f"spatial_merge_size must be >= 1, got {self.spatial_merge_size!r}")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})"
            )
        head_dim = self.hidden // self.num_heads
        if head_dim % 4:
            # Half of each head's rotary pairs encode the row, half the column.
            raise ValueError(
                f"head_dim = hidden // num_heads must be divisible by 4, got {head_dim}"
            )
        if self.window_size is not None and self.window_size < 1:
            raise ValueError(f"window_size must be None or >= 1, got {self.window_size!r}")
        _check_indexes("fullatt_block_indexes", self.fullatt_block_indexes, self.depth)
        _check_indexes("deepstack_indexes", self.deepstack_indexes, self.depth)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def _patch_layout(grid_thw: Tensor, num_patches: int, m: int) -> tuple[Tensor, Tensor, Tensor]:
    """Global frame id, row and column of every patch row, from tensor ops only.

    No ``.tolist()`` so dynamo can trace it with an unbacked ``num_patches``.
    """
    t, h, w = grid_thw.unbind(1)
    frame_size = h * w
    image_size = t * frame_size
    arange = torch.arange(grid_thw.shape[0], device=grid_thw.device)
    image = torch.repeat_interleave(arange, image_size, output_size=num_patches)
    image_start = torch.cumsum(image_size, 0) - image_size
    frame_start = torch.cumsum(t, 0) - t
    local = torch.arange(num_patches, device=grid_thw.device) - image_start[image]
    # Divisors clamped to >= 1, which they are for every valid grid: the kernel torch 2.11's
    # inductor generates for this on the CPU (unbacked sizes) died with SIGFPE, an integer
    # division by zero, without the clamp.
    own_frame_size = frame_size[image].clamp_min(1)
    frame_id = frame_start[image] + local // own_frame_size
    p = local % own_frame_size
    block, r = p // (m * m), p % (m * m)
    blocks_per_row = (w[image] // m).clamp_min(1)
    row = (block // blocks_per_row) * m + r // m
    col = (block % blocks_per_row) * m + r % m
    return frame_id, row, col


def gather_blocks(x: Tensor, index: Tensor, m: int) -> Tensor:
    """Reorder rows of ``x`` by whole merge blocks of ``m*m`` rows, as ``index`` says."""
    return x.unflatten(0, (-1, m * m))[index].flatten(0, 1)


class Merger(nn.Module):
    """Norm, then one row per merge block (m*m patches side by side), then an MLP."""

    def __init__(self, hidden: int, m: int, out_dim: int) -> None:
        super().__init__()
        self.m = m
        width = hidden * m * m
        self.norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, out_dim))

    def forward(self, x: Tensor) -> Tensor:
        # unflatten/flatten instead of reshape(-1, k): inductor can specialize an unbacked row
        # count through reshape on a non-contiguous view. The check tells dynamo the rows split
        # into blocks, which torch before 2.10 cannot prove for unbacked rows (FX needs no hint).
        if torch.compiler.is_compiling():
            torch._check(x.shape[0] % (self.m * self.m) == 0)
        return self.mlp(self.norm(x).unflatten(0, (-1, self.m * self.m)).flatten(1))


class PreNormBlock(nn.Module):
    """The layers of a pre-norm transformer block; subclasses say how attention is restricted."""

    def __init__(self, hidden: int, num_heads: int, mlp_hidden: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, mlp_hidden), nn.GELU(), nn.Linear(mlp_hidden, hidden)
        )


class _VisionBlock(PreNormBlock):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__(config.hidden, config.num_heads, config.mlp_hidden)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, segments: Segments, bands=None
    ) -> Tensor:
        """``bands``: the step's ``Bands`` in a layer attending over whole frames on a step with
        bands (``fx_vitbal.runtime.bands.view``): the library runs that attention."""
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, self.num_heads, -1)).unbind(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        out = attend(q, k, v, segments) if bands is None else bands.attention(q, k, v)
        x = x + self.proj(out.transpose(0, 1).flatten(1))
        return x + self.mlp(self.norm2(x))


class QwenStyleViT(nn.Module):
    """A tiny vision tower with the row layout, attention segments and outputs of Qwen2/2.5/3-VL.

    ``forward(pixel_values, image_grid_thw)`` returns ``(pixel_embeds, window_index, deepstack)``:
    ``pixel_embeds`` is ``[N, hidden]`` before the merger (``[N / m**2, out_dim]`` with
    ``merged_output``); with windows it is in window order, whole merge blocks of ``m**2`` rows
    permuted by ``window_index`` (un-permute with ``argsort(window_index)``), otherwise it is in
    input order and ``window_index`` is ``None``. ``deepstack`` holds one ``[N / m**2, out_dim]``
    tensor per ``config.deepstack_indexes`` entry, in the same order.
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_embed = nn.Linear(config.in_dim, config.hidden)
        self.blocks = nn.ModuleList(_VisionBlock(config) for _ in range(config.depth))
        m = config.spatial_merge_size
        if config.merged_output:
            self.merger = Merger(config.hidden, m, config.out_dim)
        self.deepstack_mergers = nn.ModuleList(
            Merger(config.hidden, m, config.out_dim) for _ in config.deepstack_indexes
        )

    def _rotary(self, row: Tensor, col: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin of shape ``[N, 1, head_dim]``: the first half of the rotary frequencies turn
        with the row, the second half with the column (Qwen2-VL's 2-D RoPE)."""
        head_dim = self.config.hidden // self.config.num_heads
        # Angles in at least float32 so low-precision models still get distinct positions.
        work = torch.promote_types(dtype, torch.float32)
        exponent = torch.arange(0, head_dim // 2, 2, dtype=work, device=row.device)
        inv_freq = 1.0 / 10000.0 ** (exponent / (head_dim // 2))
        angles = torch.cat((row[:, None].to(work) * inv_freq, col[:, None].to(work) * inv_freq), 1)
        angles = torch.cat((angles, angles), 1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _window_index_and_lengths(self, image_grid_thw: Tensor) -> tuple[Tensor, Tensor]:
        """Merged-token permutation into window order and the window lengths in patches.

        Per image and frame, the merged grid is padded up to a multiple of ``window_size``, cut
        into windows, and the padding and empty windows are dropped, so no window spans two
        frames or images. Indexes are offset by the earlier images' merged-token counts.
        """
        ws = self.config.window_size
        if ws is None:
            raise ValueError("window index requested but config.window_size is None")
        m = self.spatial_merge_size
        device = image_grid_thw.device
        indexes = [torch.zeros(0, dtype=torch.long, device=device)]
        lengths = [torch.zeros(0, dtype=torch.long, device=device)]
        offset = 0
        for t, h, w in image_grid_thw.tolist():
            gh, gw = h // m, w // m
            nh, nw = -(-gh // ws), -(-gw // ws)
            padded = torch.full((t, nh * ws, nw * ws), -1, dtype=torch.long, device=device)
            padded[:, :gh, :gw] = torch.arange(t * gh * gw, device=device).view(t, gh, gw)
            windows = padded.view(t, nh, ws, nw, ws).transpose(2, 3).reshape(t * nh * nw, -1)
            valid = windows >= 0
            counts = valid.sum(1)
            indexes.append(windows[valid] + offset)
            lengths.append(counts[counts > 0] * m * m)
            offset += t * gh * gw
        return torch.cat(indexes), torch.cat(lengths)

    def get_window_index(self, image_grid_thw: Tensor) -> Tensor:
        """Permutation of the ``N / m**2`` merged tokens into window order (the ``window_index``
        that ``forward`` returns), e.g. to regenerate it from an original grid.

        Raises ``ValueError`` when ``config.window_size`` is ``None``.
        """
        return self._window_index_and_lengths(image_grid_thw)[0]

    def forward(
        self, pixel_values: Tensor, image_grid_thw: Tensor, vitbal_bands=None
    ) -> tuple[Tensor, Tensor | None, list[Tensor]]:
        """Encode ``pixel_values [N, in_dim]`` laid out by ``image_grid_thw [n, 3]``.

        ``vitbal_bands``: on a step whose balancing plan splits a frame into row bands, the
        ``fx_vitbal.Bands`` of this batch (``BandSupport``): a band's patches sit at its frame's
        rows, and full-attention blocks attend over its whole frame."""
        m = self.spatial_merge_size
        num_patches = pixel_values.shape[0]
        frame_id, row, col = _patch_layout(image_grid_thw, num_patches, m)
        full = None
        if vitbal_bands is not None:
            table = vitbal_bands.unit_table(row.device)
            frames, rows, first_rows, _, width = table.unbind(1)
            patches = frames * rows * width
            row = row + torch.repeat_interleave(first_rows, patches, output_size=num_patches)
            full = vitbal_bands  # the library runs the whole-frame attention (Bands.attention)
        cos, sin = self._rotary(row, col, pixel_values.dtype)
        x = self.patch_embed(pixel_values)

        window_index = None
        window_segments: Segments = []  # only read by windowed blocks
        if self.config.window_size is not None:
            window_index, window_lengths = self._window_index_and_lengths(image_grid_thw)
            x, cos, sin, frame_id = (
                gather_blocks(a, window_index, m) for a in (x, cos, sin, frame_id)
            )
            arange = torch.arange(window_lengths.shape[0], device=x.device)
            window_id = torch.repeat_interleave(arange, window_lengths, output_size=num_patches)
            window_segments = segments_of(window_id)
        # Windows are frame-major, so each frame is still one contiguous run after reordering.
        frame_segments = segments_of(frame_id)

        deepstack = []
        for i, block in enumerate(self.blocks):
            windowed = (
                self.config.window_size is not None and i not in self.config.fullatt_block_indexes
            )
            if windowed:  # windows stay inside a band
                x = block(x, cos, sin, window_segments)
            else:
                x = block(x, cos, sin, frame_segments, full)
            if i in self.config.deepstack_indexes:
                merger = self.deepstack_mergers[self.config.deepstack_indexes.index(i)]
                deepstack.append(merger(x))
        return self.merger(x) if self.config.merged_output else x, window_index, deepstack


def _architecture_cost(vit: QwenStyleViT) -> ArchitectureCost:
    config = vit.config
    windowed = config.window_size is not None
    return ArchitectureCost(
        hidden=config.hidden,
        mlp_hidden=config.mlp_hidden,
        depth=config.depth,
        in_dim=config.in_dim,
        out_dim=config.out_dim,
        spatial_merge_size=config.spatial_merge_size,
        full_attention_layers=len(config.fullatt_block_indexes) if windowed else None,
        window_patches=(config.window_size * config.spatial_merge_size) ** 2 if windowed else None,
        per_frame=True,
        num_mergers=int(config.merged_output) + len(config.deepstack_indexes),
    )


def _full_attention_blocks(vit: QwenStyleViT) -> int:
    config = vit.config
    return len(config.fullatt_block_indexes) if config.window_size else config.depth


# Attention, rotary positions and windows are all per frame, so frames may be split across ranks;
# a frame's row bands too, starting at whole windows (or merge rows without windows).
register_vision_encoder(
    QwenStyleViT,
    frame_independent=True,
    cost_model=_architecture_cost,
    pixel_width=lambda vit: vit.config.in_dim,
    bands=BandSupport(
        align_rows=lambda vit: vit.spatial_merge_size * (vit.config.window_size or 1),
        exchange_layers=_full_attention_blocks,
        width=lambda vit: vit.config.hidden,
        compiled=True,
        heads=lambda vit: vit.config.num_heads,
    ),
)
