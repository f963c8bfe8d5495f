"""Shared test configuration: hypothesis profiles and fresh random generators per test."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

if torch.version.cuda is None:  # a CPU build: Triton kernels can only run in its interpreter,
    os.environ.setdefault("TRITON_INTERPRET", "1")  # set before anything imports a kernel module

settings.register_profile("ci", deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=500,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("quick", deadline=None, max_examples=3,  # under compute-sanitizer
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A CPU generator with a fresh seed per test; the seed is kept in the test report."""
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("torch_seed", seed))
    return torch.Generator().manual_seed(seed)


def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None:
        seeds = [v for k, v in item.user_properties if k == "torch_seed"]
        if seeds:
            item.add_report_section("call", "seed", f"torch_seed={seeds[0]} (replay with this seed)")
