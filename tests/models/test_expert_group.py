"""A mixture's routed experts side by side in one C++ call (models/expert_group.py) against
the layer's own loop over them: each expert's output on its rows, for SwiGLU and relu^2
experts, with the projections on panel_linear (either vector width) and on oneDNN, experts
nobody picked, under the inference mode a worker steps in; its refusals of counts that do not
describe the rows; the loop where the group cannot run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from kernels.cpu import ops as cpu_kernels
from models import expert_group
from models.layers import pack_linears, stack_projections
from models.mlp import GatedMLP, Relu2MLP
from models.moe import run_experts
from tests.kernels.cpu.vector_widths import VECTOR_BITS

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")

HIDDEN, WIDTH, EXPERTS = 64, 32, 7
# Rows an expert: none (never picked), one and three (panel_linear where the row limit allows),
# nine and twenty (oneDNN).
COUNTS = [3, 0, 20, 1, 9, 0, 3]


@pytest.fixture(autouse=True)
def two_threads():
    """A team of two, where tests/models runs one: the experts then go to both threads, the
    second of which must step in the caller's inference mode."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _experts(gated: bool, packed: bool = True) -> nn.ModuleList:
    gen = torch.Generator().manual_seed(int(gated))
    experts = nn.ModuleList(
        GatedMLP(HIDDEN, WIDTH) if gated else Relu2MLP(HIDDEN, WIDTH, bias=True) for _ in range(EXPERTS)
    )
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    if packed:
        stack_projections(experts)
        pack_linears(experts)
    return experts.eval()


def _loop(experts: nn.ModuleList, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The layer's loop: each expert's forward on its own rows, in expert order."""
    return torch.cat([expert(part) for expert, part in zip(experts, rows.split(counts))])


def _rows() -> torch.Tensor:
    return torch.randn(sum(COUNTS), HIDDEN, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("vector_bits", VECTOR_BITS)
@pytest.mark.parametrize("panel_rows", [0, 4], ids=["onednn", "panel_linear"])
@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "relu2"])
def test_group_is_each_experts_forward(gated, panel_rows, vector_bits):
    choice = cpu_kernels.decide(True)
    assert choice.on, choice.why
    rows = _rows()
    with cpu_kernels.using(dataclasses.replace(choice, panel_rows=panel_rows, vector_bits=vector_bits)):
        experts = _experts(gated)
        assert any(e.down_proj.panels is not None for e in experts) == bool(panel_rows)
        with torch.inference_mode():
            grouped = expert_group.forward(experts, rows, COUNTS)
            want = _loop(experts, rows, COUNTS)
    assert grouped is not None
    # oneDNN splits a matmul across threads in the loop and runs it on one in the group: the
    # sums may round differently, nothing more.
    assert (grouped - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    if panel_rows:
        small = [n <= panel_rows for n in COUNTS for _ in range(n)]
        assert torch.equal(grouped[small], want[small])


@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "relu2"])
@torch.inference_mode()
def test_grouped_run_equals_the_per_token_sum(gated):
    """run_experts through the group: every token's weighted sum over its own experts, tokens
    that pick the same expert twice included."""
    experts = _experts(gated)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(29, HIDDEN, generator=gen)
    ids = torch.randint(0, EXPERTS - 1, (29, 3), generator=gen)
    weights = torch.rand(29, 3, generator=gen)
    assert expert_group.forward(experts, x[:1], [1] + [0] * (EXPERTS - 1)) is not None
    want = torch.stack(
        [sum(weights[t, k] * experts[int(ids[t, k])](x[t : t + 1])[0] for k in range(3)) for t in range(29)]
    )
    assert (run_experts(experts, x, weights, ids) - want).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    ("counts", "error"),
    [
        ([3, 0, 20, 1, 9, 0, 2], "the counts sum to 35, not the 36 rows"),
        ([3, 0, 20, 1, 9, 3], "one count an expert: 6 for 7"),
        ([3, 0, 20, 1, 9, 4, -1], "a negative count"),
    ],
)
@torch.inference_mode()
def test_group_refuses_counts_that_do_not_describe_the_rows(counts, error):
    experts = _experts(gated=False)
    with pytest.raises(RuntimeError, match=error):
        expert_group.forward(experts, _rows(), counts)


def test_the_loop_where_the_group_cannot_run():
    rows = _rows()
    with torch.inference_mode():
        assert expert_group.forward(_experts(gated=True, packed=False), rows, COUNTS) is None
        assert expert_group.forward(_experts(gated=True), rows.double(), COUNTS) is None
        with cpu_kernels.using(cpu_kernels.decide(False)):
            assert expert_group.forward(_experts(gated=True), rows, COUNTS) is None
    assert expert_group.forward(_experts(gated=True), rows, COUNTS) is None  # gradients recorded
