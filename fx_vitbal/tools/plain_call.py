"""A ViT called plainly, outside balancing, as the contract's triple ``(embeds, window_index,
deepstack)``: what ``check_vision_encoder`` compares. A Hugging Face tower is called through its
``HFTowerRule`` (its restored fields; on bands, the rule's recipe as a balanced call runs it).
"""

from torch import Tensor, nn

from fx_vitbal.integrations import hf_bands
from fx_vitbal.integrations.hf import is_hf_model
from fx_vitbal.integrations.hf_outputs import restored_rows
from fx_vitbal.integrations.hf_towers import HFTowerRule, hf_tower_rule
from fx_vitbal.runtime.bands.view import Bands
from fx_vitbal.runtime.vit.registry import plain_forward, unwrap_module


def hf_rule(vit: nn.Module) -> HFTowerRule | None:
    """The rule of a Hugging Face tower (None for other ViTs).

    Raises:
        TypeError: a Hugging Face tower without a rule (the message names the registry).
    """
    inner = unwrap_module(vit)
    return hf_tower_rule(type(inner)) if is_hf_model(inner) else None


def plain_call(model: nn.Module, pixels: Tensor, grid_thw: Tensor, bands: Bands | None = None):
    # A ViT wrapped by enable_vit_balance would start collectives: call the plain forward.
    rule = hf_rule(model)
    if rule is not None:  # the fields the rule restores, as the contract's triple
        kwargs = {}
        if bands is not None:  # the rule's recipe, as a balanced call runs it
            hf_bands.install(unwrap_module(model), rule.bands)
            kwargs = hf_bands.band_kwargs(unwrap_module(model), rule.bands, bands, pixels.device)
            grid_thw = kwargs.pop("grid_thw", grid_thw)
        out = plain_forward(model)(pixels, grid_thw=grid_thw, return_dict=True, **kwargs)
        values = restored_rows(rule, out)
        return values[0], None, values[1:]
    kwargs = {} if bands is None else {"vitbal_bands": bands}
    result = plain_forward(model)(pixels, grid_thw, **kwargs)
    if not (isinstance(result, tuple | list) and len(result) == 3):
        raise TypeError(
            f"{type(model).__qualname__}(pixel_values, image_grid_thw) must return "
            f"(pixel_embeds, window_index, deepstack), got {type(result).__qualname__}"
        )
    return result
