"""Host <-> device copies: the event that says a copy landed is on the copy's device, and the
runtime's host tensors stay on the host whatever the default device."""

import copy

import torch
import torch.distributed as dist
from dist_utils import assert_units_moved, record_moves, run_ranks

import fx_vitbal
from fx_vitbal.runtime.transport import transfer
from fx_vitbal.tools.models import ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs


class _Event:
    def record(self, stream) -> None:
        self.stream = stream


def test_a_copy_event_is_recorded_on_the_stream_of_the_copys_device(monkeypatch):
    # The current device is cuda:0 (the default of ``current_stream()``); the data is on cuda:1,
    # whose stream the copy was queued on: an event on cuda:0 could complete before it lands.
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: ("stream of", device or "cuda:0")
    )
    event = transfer.copy_event(torch.device("cuda", 1))
    assert event.stream == ("stream of", torch.device("cuda", 1))


def test_host_copies_of_host_tensors_wait_for_nothing(monkeypatch):
    monkeypatch.setattr(transfer, "wait", lambda event: (_ for _ in ()).throw(AssertionError))
    assert transfer.HostCopy(torch.tensor([3, 4])).values() == [3, 4]


def _under_a_default_device(rank: int, world: int) -> dict:
    """Two balanced steps (in place, then planned ahead) with ``torch.set_default_device("meta")``,
    a device the runtime must never make its host tensors on, against the unbalanced model."""
    torch.manual_seed(0)
    model = OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1))
    reference = copy.deepcopy(model)
    balanced = fx_vitbal.enable_vit_balance(model)
    group = dist.new_group(backend="gloo")
    grids = [[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]], []][rank]  # skewed, and a rank without images
    input_ids, pixels, grid = make_inputs(grids, in_dim=24, seed=rank)
    want = reference(input_ids, pixels, grid)
    got = {}
    with record_moves() as moves:
        torch.set_default_device("meta")
        try:
            got["in_place"] = balanced(input_ids, pixels, grid)
            plan = fx_vitbal.plan_ahead(balanced.visual, pixels, grid, group=group)
            fx_vitbal.use_plan(balanced, plan)
            got["ahead"] = balanced(input_ids, pixels, grid)
            for logits in got.values():
                logits.pow(2).mean().backward()
        finally:
            torch.set_default_device(None)
    for path, logits in got.items():
        torch.testing.assert_close(logits, want, msg=f"{path} on rank {rank}")
    return {"moves": moves}


def test_a_default_device_moves_none_of_the_runtimes_host_tensors():
    assert_units_moved(run_ranks(_under_a_default_device, 3))
