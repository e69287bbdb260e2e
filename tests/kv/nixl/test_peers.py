"""A rank's peer table (kv/nixl/peers.py): a remote engine is found by its rank-0 agent only
with every rank registered, a removed agent is gone for good, and a load reads from or
notifies the remote ranks its TP sizes pair it with, counting readers where several read."""

from __future__ import annotations

import pytest

from kv.nixl.notif_counts import counted
from kv.nixl.peers import Peer, PeerInfo, PeerTable
from kv.nixl.tp_slices import PageSlicer
from models.config import ModelConfig
from training.tiny_configs import nemotron_h


def peer(engine: str, rank: int = 0, size: int = 1) -> Peer:
    agent = f"{engine}-agent" + (f"-tp{rank}" if rank else "")
    info = PeerInfo(engine, agent, b"", (0,), 64, 4, "DRAM", 0, rank, size, f"{engine}-agent")
    return Peer(info, None)


def slicer(rank: int, size: int) -> PageSlicer:
    cfg = ModelConfig.from_hf_dict(nemotron_h())
    return PageSlicer(cfg, 4, "bfloat16", rank, size, ("attention", "mamba"))


def test_an_engine_is_found_by_its_rank0_agent_with_every_rank_in_order():
    table = PeerTable(None)
    with pytest.raises(ValueError, match="unknown peer 'e-agent'"):
        table.engine("e-agent")
    second, first = peer("e", 1, 2), peer("e", 0, 2)
    table.add(second)
    with pytest.raises(ValueError, match="has 1 of its 2 ranks registered"):
        table.engine("e-agent")
    table.add(first)
    assert table.engine("e-agent") == [first, second]
    assert sorted(table.of_engine("e")) == ["e-agent", "e-agent-tp1"]


def test_a_removed_agent_is_gone_for_good():
    table = PeerTable(None)
    kept, gone = peer("keep"), peer("gone")
    table.add(kept)
    table.add(gone)
    assert table.remove("gone-agent") is gone
    assert "gone-agent" in table.removed and "gone-agent" not in table.by_name
    assert table.of_engine("gone") == []
    with pytest.raises(ValueError, match="unknown peer"):
        table.engine("gone-agent")
    assert table.engine("keep-agent") == [kept]


@pytest.mark.parametrize("rank", [0, 1])
def test_equal_tp_sizes_pair_rank_with_rank(rank):
    table = PeerTable(slicer(rank, 2))
    ranks = [peer("e", r, 2) for r in range(2)]
    assert table.targets(ranks, "r") == [(ranks[rank], "r")]
    assert PeerTable(None).targets([peer("f")], "r")[0][1] == "r"


def test_a_remote_rank_read_by_several_ranks_waits_for_each():
    # Decode TP 2 from prefill TP 1: both decode ranks read the one prefill rank's heads.
    remote = [peer("e")]
    for rank in range(2):
        assert PeerTable(slicer(rank, 2)).targets(remote, "r") == [(remote[0], counted("r", 2))]


def test_one_rank_reading_several_notifies_each_once():
    # Decode TP 1 from prefill TP 2: the one decode rank reads both prefill ranks' heads.
    remote = [peer("e", r, 2) for r in range(2)]
    assert PeerTable(slicer(0, 1)).targets(remote, "r") == [(remote[0], "r"), (remote[1], "r")]
