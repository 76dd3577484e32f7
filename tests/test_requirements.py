"""The torch requirement admits every supported torch, NVIDIA's container builds included, so
installing fx_vitbal never replaces the torch a training stack was set up with."""

import importlib.metadata

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version


def _torch_requirement() -> Requirement:
    requirements = [Requirement(r) for r in importlib.metadata.requires("fx_vitbal")]
    return next(r for r in requirements if r.name == "torch" and r.marker is None)


@pytest.mark.parametrize(
    "version",
    [
        "2.8.0",
        "2.8.0a0+5228986c39.nv25.06",  # NVIDIA PyTorch container 25.06 (LoongForge)
        "2.9.1",
        "2.10.0",
        "2.11.0+cu130",  # VeOmni, verl, the lent H200
        "2.13.0",
        "2.13.0a0+8a0bbdf.nv26.06",  # NVIDIA PyTorch container 26.06 (Megatron)
        "2.14.1",
        "2.15.0+cu132",  # PyPI's Linux wheel
    ],
)
def test_the_torch_requirement_admits_every_supported_build(version):
    # pip keeps an installed torch that satisfies the requirement, pre-release or not.
    assert _torch_requirement().specifier.contains(Version(version), prereleases=True)


@pytest.mark.parametrize("version", ["2.7.1", "2.7.0a0+79aa17489c.nv25.04", "2.6.0"])
def test_the_torch_requirement_refuses_torch_older_than_2_8(version):
    assert not _torch_requirement().specifier.contains(Version(version), prereleases=True)


def test_the_installed_torch_satisfies_the_requirement():
    installed = Version(torch.__version__.split("+")[0])
    assert _torch_requirement().specifier.contains(installed, prereleases=True)
