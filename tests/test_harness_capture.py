"""decode_graph's replay-vs-eager logic, on the CPU fallback (no capture without CUDA)."""

from __future__ import annotations

import pytest
import torch

from vllm_sparse_sync.testing import decode_graph
from vllm_sparse_sync.testing.capture import flatten_tensors


def _step_factory():
    lens = torch.tensor([3, 5], dtype=torch.int32)
    out = torch.zeros(2, dtype=torch.int32)

    def step():
        out.copy_(lens * 2)
        return out

    return lens, out, step


def test_flatten_tensors_walks_containers_and_dataclasses():
    from dataclasses import dataclass

    @dataclass
    class M:
        a: torch.Tensor
        n: int
        b: tuple

    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    assert [t.item() for t in flatten_tensors(M(a, 3, (b, {"z": c})))] == [0.0, 1.0, 2.0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU fallback only")
def test_check_against_eager_compares_with_the_reference():
    lens, out, step = _step_factory()
    g = decode_graph(step, inputs=[lens])
    assert not g.captured

    def mutate(i):
        lens.copy_(torch.tensor([i + 1, 2 * i + 1], dtype=torch.int32))

    res = g.check_against_eager(mutate, cases=3, reference=lambda: lens * 2, expect_change=True)
    assert [r["changed"] for r in res] == [True, True, True]
    with pytest.raises(AssertionError, match="replay vs reference"):
        g.check_against_eager(mutate, cases=1, reference=lambda: lens * 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU fallback only")
def test_check_against_eager_rejects_moved_inputs_and_baked_values():
    lens, out, step = _step_factory()
    g = decode_graph(step, inputs=[lens])
    holder = {}

    def rebind():
        holder["x"] = torch.zeros(2)
        g.inputs[0] = holder["x"]

    with pytest.raises(AssertionError, match="input moved"):
        g.check_against_eager([rebind])
    lens2, _, step2 = _step_factory()
    g2 = decode_graph(step2, inputs=[lens2])
    with pytest.raises(AssertionError, match="did not change"):
        g2.check_against_eager([lambda: None, lambda: None], expect_change=True)
