"""The simulated accelerator of the sync tests (``accelerator_sim``) counts every kind of host
sync, host wait and host/device mix it claims to, each once, and nothing else: run one at a time
on would-be device tensors, from this file (so they count as the model's, not the library's)."""

import pytest
import torch
from accelerator_sim import DEVICE, simulated_accelerator

HOST = torch.arange(12.0).view(4, 3) - 5.0
MASK = torch.tensor([True, False, True, False])

# name: (what runs, given the device tensor ``d`` and a host tensor ``h``; the record it adds)
CASES = {
    ".item()": (lambda d, h: d[0, 0].item(), "model_syncs"),
    "bool()": (lambda d, h: bool(d.sum() > 0), "model_syncs"),
    "int()": (lambda d, h: int(d[0, 0]), "model_syncs"),
    "float()": (lambda d, h: float(d[0, 0]), "model_syncs"),
    "index by a 0-d device tensor": (lambda d, h: h[d[2, 0].long()], "model_syncs"),
    "allclose": (lambda d, h: torch.allclose(d, d), "model_syncs"),
    "equal": (lambda d, h: torch.equal(d, d), "model_syncs"),
    "nonzero": (lambda d, h: d.nonzero(), "model_syncs"),
    "masked_select": (lambda d, h: torch.masked_select(d, d > 0), "model_syncs"),
    "unique": (lambda d, h: torch.unique(d), "model_syncs"),
    "bincount": (lambda d, h: torch.bincount(d.flatten().long().clamp(min=0)), "model_syncs"),
    "histc": (lambda d, h: torch.histc(d, 4, -5.0, 7.0), "model_syncs"),
    "repeat_interleave by a tensor": (
        lambda d, h: torch.repeat_interleave(d, d[:, 0].long().clamp(min=0), dim=0),
        "model_syncs",
    ),
    "boolean-mask index": (lambda d, h: d[d[:, 0] > 0], "model_syncs"),
    # (``d[mask] = 0.0`` becomes index_put_ or, from torch 2.15, a sync-free masked_fill_.)
    "boolean-mask assignment": (
        lambda d, h: d.index_put_((d > 0,), d.new_zeros(())),
        "model_syncs",
    ),
    ".tolist()": (lambda d, h: d.tolist(), "model_syncs"),
    ".numpy()": (lambda d, h: d.numpy(), "model_syncs"),
    ".cpu()": (lambda d, h: d.cpu(), "model_syncs"),
    '.to("cpu")': (lambda d, h: d.to("cpu"), "model_syncs"),
    '.to("cpu:0")': (lambda d, h: d.to("cpu:0"), "model_syncs"),
    ".to(a host tensor)": (lambda d, h: d.to(h), "model_syncs"),
    ".to(device=cpu)": (lambda d, h: d.to(device=torch.device("cpu")), "model_syncs"),
    ".type(a host type)": (lambda d, h: d.type(torch.DoubleTensor), "model_syncs"),
    "copy_ to the host": (lambda d, h: h.copy_(d), "model_syncs"),
    "slice assignment on the host": (lambda d, h: h.__setitem__(slice(0, 2), d[:2]), "model_syncs"),
    "copy_ to the device": (lambda d, h: d.copy_(h), "model_syncs"),
    ".to(the device)": (lambda d, h: h.to(d.device), "model_syncs"),
    "torch.tensor(..., device=)": (
        lambda d, h: torch.tensor([1, 2], device=d.device),
        "model_syncs",
    ),
    "torch.as_tensor(..., device=)": (
        lambda d, h: torch.as_tensor([1, 2], device=d.device),
        "model_syncs",
    ),
    "new_tensor": (lambda d, h: d.new_tensor([1.0, 2.0]), "model_syncs"),
    "torch.tensor of device scalars": (
        lambda d, h: torch.tensor([d[0, 0], d[1, 1]]),
        "model_syncs",
    ),
    "torch.cuda.synchronize": (lambda d, h: torch.cuda.synchronize(), "model_waits"),
    "an event's synchronize": (lambda d, h: torch.cuda.Event.synchronize(None), "model_waits"),
    "a stream's synchronize": (lambda d, h: torch.cuda.Stream.synchronize(None), "model_waits"),
    "a host tensor with a device tensor": (lambda d, h: d + h, "model_mixed"),
    "a host index into a device tensor": (lambda d, h: d[torch.tensor([0, 2])], "model_mixed"),
    "non-blocking copy to the device": (
        lambda d, h: h.to(d.device, non_blocking=True),
        "model_copies",
    ),
    "non-blocking copy to the host": (lambda d, h: d.to("cpu", non_blocking=True), "model_copies"),
    # What costs nothing: device arithmetic, host scalars, tensors made on the device.
    "device arithmetic": (lambda d, h: (d * 2 + d.sum(0)).relu(), None),
    "a 0-d host tensor": (lambda d, h: d * torch.tensor(2.0), None),
    "repeat_interleave by an int": (lambda d, h: torch.repeat_interleave(d, 2, dim=0), None),
    "made on the device": (lambda d, h: d + torch.zeros(4, 3, device=d.device), None),
    "made like a device tensor": (lambda d, h: d + torch.zeros_like(d) + d.new_zeros(4, 3), None),
    "a mask applied by where": (lambda d, h: torch.where(d > 0, d, 0.0), None),
    "an index made on the device": (
        lambda d, h: d.index_select(0, torch.arange(2, device=d.device)),
        None,
    ),
}
KINDS = ("syncs", "waits", "mixed", "copies") + ("model_syncs", "model_waits", "model_mixed")
KINDS += ("model_copies",)


@pytest.mark.parametrize("case", list(CASES))
def test_every_kind_of_sync_it_claims_to_count_is_counted_once(case):
    run, kind = CASES[case]
    with simulated_accelerator() as simulation:
        device = simulation.on_accelerator(HOST.clone())
        assert device.device == DEVICE and HOST.device == torch.device("cpu")
        run(device, HOST.clone())
    counts = {k: len(simulation.record[k]) for k in KINDS}
    assert counts == {k: int(k == kind) for k in KINDS}, simulation.record
    if kind is not None:
        assert "test_accelerator_sim.py" in simulation.record[kind][0]


def test_library_lines_are_counted_apart_from_the_models():
    from fx_vitbal.runtime.agree import metadata
    from fx_vitbal.runtime.transport import transfer

    with simulated_accelerator() as simulation:
        device = simulation.on_accelerator(HOST.clone())
        metadata._read_grid(device, None)  # the library reads a device grid
        transfer.HostCopy(device).values()  # queued by the library, waited for by this file
        device.tolist()  # this file reads
    record = simulation.record
    assert [r.split(":")[0] for r in record["syncs"]] == ["metadata.py"], record
    assert [r.split(":")[0] for r in record["copies"]] == ["transfer.py"], record
    assert len(record["model_waits"]) == 1 and len(record["model_syncs"]) == 1, record
    assert torch.zeros(1, device=DEVICE).device.type == "cpu"  # the device is the CPU's memory
