"""Per-unit ViT cost models.

A *unit* is one row ``(t, h, w)`` of ``image_grid_thw`` (or one frame of it, ``t = 1``), in patch
units. A cost model is any callable ``(t, h, w) -> float``; only ratios between units matter, so
the models return work in arbitrary units (multiply-accumulates for the architecture model).

Why not just the seed's ``(t*h*w)**2``: a ViT layer spends ``~12*d**2`` MACs per token in its
linear layers and ``~2*d*s`` in attention over a segment of ``s`` tokens, so attention only
dominates once ``s > 6*d`` (7.7k tokens for Qwen2-VL's d=1280). Real images are mostly below that,
and the quadratic model then overweights large images and underweights many small ones.
"""

import dataclasses
import json
from collections.abc import Callable, Sequence

CostModel = Callable[[int, int, int], float]


@dataclasses.dataclass(frozen=True)
class QuadraticCost:
    """The seed's model: ``(t*h*w)**2`` (self-attention over the whole unit, nothing else)."""

    def __call__(self, t: int, h: int, w: int) -> float:
        return float(t * h * w) ** 2


@dataclasses.dataclass(frozen=True)
class PolynomialCost:
    """``a*l**2 + b*l + c`` with ``l = t*h*w`` tokens (the seed's calibrated VLM-mode model)."""

    a: float
    b: float
    c: float

    def __call__(self, t: int, h: int, w: int) -> float:
        tokens = t * h * w
        return self.a * tokens * tokens + self.b * tokens + self.c

    @classmethod
    def fit(cls, tokens: Sequence[int], seconds: Sequence[float]) -> "PolynomialCost":
        """Least-squares fit of measured times, weighted by ``1/seconds`` (relative error).

        Relative weighting keeps small images (most of a batch) from being drowned by the largest
        sample. Negative coefficients are clipped to zero so costs stay monotone in ``l``.

        Raises:
            ValueError: fewer than three samples, mismatched lengths or non-positive times.
        """
        import torch  # local: the pure-Python planner path must not need it

        if len(tokens) != len(seconds) or len(tokens) < 3:
            raise ValueError(
                f"fit needs >= 3 (tokens, seconds) pairs of equal length, got {len(tokens)} and "
                f"{len(seconds)}"
            )
        if any(s <= 0 for s in seconds) or any(n <= 0 for n in tokens):
            raise ValueError("fit needs positive token counts and positive times")
        x = torch.tensor(tokens, dtype=torch.float64)
        y = torch.tensor(seconds, dtype=torch.float64)
        design = torch.stack([x * x, x, torch.ones_like(x)], dim=1) / y[:, None]
        solution = torch.linalg.lstsq(design, torch.ones_like(y)[:, None]).solution.flatten()
        a, b, c = (max(float(v), 0.0) for v in solution)
        return cls(a, b, c)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArchitectureCost:
    """Forward multiply-accumulates of a Qwen-style ViT for one unit, from its dimensions.

    Backward costs ~2x forward for every term, so the ratio between units (all the planner uses)
    is the same for forward-only and forward+backward.
    """

    hidden: int
    mlp_hidden: int
    depth: int
    in_dim: int
    out_dim: int
    spatial_merge_size: int = 2
    full_attention_layers: int | None = None
    """Layers attending over whole segments; the rest use windows. ``None`` = all ``depth``."""
    window_patches: int | None = None
    """Patches per attention window (Qwen2.5-VL: (112/14)**2 = 64); needed if some layers window."""
    per_frame: bool = True
    """Attention segments are frames (``t`` segments of ``h*w``), else the whole clip."""
    gated_mlp: bool = False
    """SwiGLU-style MLP with three matrices instead of two."""
    num_mergers: int = 1
    """Patch mergers (1 + deepstack mergers for Qwen3-VL)."""

    def __post_init__(self) -> None:
        for name in ("hidden", "mlp_hidden", "depth", "in_dim", "out_dim", "spatial_merge_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ArchitectureCost.{name} must be > 0, got {getattr(self, name)}")
        full = self.depth if self.full_attention_layers is None else self.full_attention_layers
        if not 0 <= full <= self.depth:
            raise ValueError(f"full_attention_layers must be in [0, depth], got {full}")
        if full < self.depth and not self.window_patches:
            raise ValueError("window_patches is required when some layers use window attention")

    def __call__(self, t: int, h: int, w: int) -> float:
        d = self.hidden
        tokens = t * h * w
        full = self.depth if self.full_attention_layers is None else self.full_attention_layers
        windowed = self.depth - full
        # q, k, v and output projections: 4*d*d MACs per token; the MLP: 2 (or 3 gated) d*mlp.
        linear = tokens * (4 * d * d + (3 if self.gated_mlp else 2) * d * self.mlp_hidden)
        # q@k^T and attn@v: 2*d MACs per (query, key) pair inside a segment.
        sum_sq = t * (h * w) ** 2 if self.per_frame else tokens**2
        full_attention = 2 * d * sum_sq
        window_attention = 2 * d * tokens * min(self.window_patches or 0, h * w)
        patch_embed = tokens * self.in_dim * d
        m2 = self.spatial_merge_size**2
        merger = (tokens // m2) * (m2 * d * m2 * d + m2 * d * self.out_dim)
        return float(
            patch_embed
            + self.depth * linear
            + full * full_attention
            + windowed * window_attention
            + self.num_mergers * merger
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnlineCost:
    """Settings of the cost model fitted online from measured per-rank ViT times.

    The fitted coefficients change every step, but every rank computes the same ones from the same
    gathered timings (``fx_vitbal.cost.online``), so what ranks must agree on, and what the planner
    fingerprint names, is only this: the kind, the prior and the window. Called as a cost model it
    is its prior, which is what the fit starts from before any timing has arrived.
    """

    prior: QuadraticCost | ArchitectureCost
    """Where the fit starts: the architecture model when the ViT's dimensions are known, else
    the seed's ``l**2``."""
    window: int = 20
    """Steps of per-rank timings the fit uses (older ones are dropped)."""
    per_frame: bool = True
    """The fit's attention feature sums ``(h*w)**2`` over a unit's frames, else it is
    ``(t*h*w)**2``. Frames by default, even for an unregistered ViT: every Qwen-family tower
    attends per frame; a ViT attending over whole clips should be registered with its
    architecture (``ArchitectureCost.per_frame=False``)."""

    def __post_init__(self) -> None:
        if type(self.prior) not in (QuadraticCost, ArchitectureCost):
            raise ValueError(
                f"OnlineCost.prior must be QuadraticCost or ArchitectureCost, got {self.prior!r}"
            )
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"OnlineCost.window must be an int >= 1, got {self.window!r}")

    def __call__(self, t: int, h: int, w: int) -> float:
        return self.prior(t, h, w)


_KINDS = {
    "quadratic": QuadraticCost,
    "polynomial": PolynomialCost,
    "architecture": ArchitectureCost,
    "online": OnlineCost,
}


def cost_to_spec(model: CostModel) -> str:
    """Serialize a built-in cost model to a JSON string (it travels as a custom-op argument)."""
    for kind, cls in _KINDS.items():
        if type(model) is cls:
            fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
            if kind == "online":
                fields["prior"] = json.loads(cost_to_spec(model.prior))
            return json.dumps({"kind": kind, **fields}, sort_keys=True)
    raise TypeError(f"only built-in cost models can be serialized, got {type(model).__name__}")


def cost_from_spec(spec: str) -> CostModel:
    """Inverse of ``cost_to_spec``."""
    fields = json.loads(spec)
    kind = fields.pop("kind")
    if kind == "online":
        fields["prior"] = cost_from_spec(json.dumps(fields["prior"]))
    return _KINDS[kind](**fields)


def choose_cost_model(
    config_cost_model: str, coeffs: Sequence[float] | None, architecture: ArchitectureCost | None
) -> CostModel:
    """Resolve a ``BalanceConfig.cost_model`` name against what is known about the ViT.

    Raises:
        ValueError: an unknown name, missing coefficients, or ``architecture`` requested for a ViT
            whose dimensions are unknown.
    """
    if config_cost_model == "quadratic":
        return QuadraticCost()
    if config_cost_model == "polynomial":
        if coeffs is None or len(coeffs) != 3:
            raise ValueError(f"the polynomial cost model needs (a, b, c), got {coeffs!r}")
        return PolynomialCost(*coeffs)
    if config_cost_model == "online":
        if architecture is None:
            return OnlineCost(prior=QuadraticCost())
        return OnlineCost(prior=architecture, per_frame=architecture.per_frame)
    if config_cost_model not in ("auto", "architecture"):
        raise ValueError(f"unknown cost model {config_cost_model!r}")
    if architecture is None:
        if config_cost_model == "architecture":
            raise ValueError(
                "cost_model='architecture' needs the ViT's dimensions; register the encoder with "
                "fx_vitbal.register_vision_encoder(..., cost_model=...)"
            )
        return QuadraticCost()
    return architecture
