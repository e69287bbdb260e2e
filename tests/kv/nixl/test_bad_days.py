"""The NIXL worker connector on bad days, real agents in this process over UCX: a READ held
past the transfer timeout fails with every block and frees the prefill side; a peer with
another cache layout is refused; a removed peer's loads fail and its agent never returns."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from kv.cache_layout import plan_layout
from kv.nixl.compat import KVCompat, KVCompatError, kv_compat
from kv.nixl.tp_slices import PageSlicer
from kv.nixl.transfer_params import KVTransferParams
from kv.nixl.verify import checksum_blocks
from kv.nixl.worker import NixlWorkerConnector
from models.config import ModelConfig
from models.model_files import load_config
from tests.kv.nixl.test_worker import finish, notified
from tests.models.hf_fixtures import save_hf_model
from training.tiny_configs import nemotron_h

PAGE, BLOCKS = 64, 4


def connector(name: str, **kw) -> NixlWorkerConnector:
    return NixlWorkerConnector(
        name, [torch.zeros(BLOCKS, PAGE, dtype=torch.uint8) for _ in range(2)], PAGE, BLOCKS, **kw
    )


@pytest.fixture
def prefill():
    conn = connector("pre")
    yield conn
    conn.close()


def test_a_read_held_past_the_timeout_fails_and_notifies(prefill):
    dec = connector("dec", transfer_timeout_s=0.2, delay_s=60.0)
    dec.add_peer(prefill.metadata())
    t0 = time.monotonic()
    dec.start_load("d", KVTransferParams("pre", prefill.agent_name, ((0, 1),), 8, "p"), [[2, 3]])
    got = finish(dec, "d")
    assert got.failed == {"d": [2, 3]} and time.monotonic() - t0 >= 0.2
    assert notified(prefill, "p")
    assert dec.transfer_stats().failed == 1
    dec.close()


def test_a_read_held_within_the_timeout_lands(prefill):
    prefill._buffers[0][1].fill_(7)
    dec = connector("dec", transfer_timeout_s=5.0, delay_s=0.1)
    dec.add_peer(prefill.metadata())
    dec.start_load("d", KVTransferParams("pre", prefill.agent_name, ((1,),), 4, "p"), [[0]])
    assert "d" in finish(dec, "d").done_recving
    assert bool((dec._buffers[0][0] == 7).all())
    dec.close()


def test_timeout_and_delay_are_validated():
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        connector("x", transfer_timeout_s=0)
    with pytest.raises(ValueError, match="delay_s"):
        connector("x", delay_s=-1)


def record(**changes) -> KVCompat:
    fields = {
        "model_digest": "abc",
        "cache_dtype": "float32",
        "block_size": 4,
        "page_bytes": PAGE,
        "attn_page_bytes": PAGE,
        "mamba_page_bytes": 0,
        "groups": ("attention:0,1",),
        "num_buffers": 2,
        "version": "0.1.0",
        "kv_checksum": "",
        "model_name": "m",
    }
    return KVCompat(**(fields | changes))


def test_a_peer_with_another_cache_is_refused_naming_every_difference():
    here = connector("here", compat=record())
    twin = connector("twin", compat=record(model_name="same-model-elsewhere"))
    here.add_peer(twin.metadata())  # the model's path may differ; its config may not
    for other, words in [
        (record(block_size=8), ["block_size 8 (peer) vs 4 (here)"]),
        (record(cache_dtype="bfloat16", version="0.2.0"), ["cache_dtype 'bfloat16'", "version '0.2.0'"]),
        (record(kv_checksum="crc32"), ["kv_checksum 'crc32' (peer) vs '' (here)"]),
    ]:
        peer = connector("peer", compat=other)
        with pytest.raises(KVCompatError) as e:
            here.add_peer(peer.metadata())
        assert all(w in str(e.value) for w in words), str(e.value)
        peer.close()
    bare = connector("bare")
    with pytest.raises(ValueError, match="no KV compatibility record"):
        here.add_peer(bare.metadata())
    assert here.peer_names == [twin.agent_name]
    for conn in (here, twin, bare):
        conn.close()


def test_kv_compat_follows_the_model_and_the_layout(tmp_path):
    save_hf_model("nemotron_h", tmp_path)
    cfg = load_config(str(tmp_path))
    four, eight = (kv_compat(str(tmp_path), plan_layout(cfg, "float32", bs, 16, None)) for bs in (4, 8))
    four.check(kv_compat(str(tmp_path), plan_layout(cfg, "float32", 4, 32, None)), "same")  # pool size is free
    with pytest.raises(KVCompatError, match=r"block_size 8 \(peer\) vs 4 \(here\)"):
        four.check(eight, "other")


def test_removed_peers_fail_their_loads_and_are_never_added_again(prefill):
    dec = connector("dec", delay_s=60.0)
    info = prefill.metadata()
    dec.add_peer(info)
    dec.start_load("in-flight", KVTransferParams("pre", prefill.agent_name, ((0,),), 4, "p1"), [[1]])
    assert dec.remove_peers("pre") == [prefill.agent_name] and dec.peer_names == []
    assert finish(dec, "in-flight").failed == {"in-flight": [1]}
    dec.start_load("later", KVTransferParams("pre", prefill.agent_name, ((0,),), 4, "p2"), [[2]])
    assert finish(dec, "later").failed == {"later": [2]}
    with pytest.raises(ValueError, match="was removed"):
        dec.add_peer(info)
    dec.close()


@pytest.mark.parametrize("corrupt_fraction", [0.0, 1.0])
def test_verified_loads_land_or_fail_on_a_corrupted_page(prefill, corrupt_fraction):
    for i, buf in enumerate(prefill._buffers):
        buf.copy_(torch.arange(BLOCKS * PAGE, dtype=torch.int64).reshape(BLOCKS, PAGE).add(i).to(torch.uint8))
    sums = checksum_blocks(prefill._buffers, [2, 3])
    dec = connector("dec", corrupt_fraction=corrupt_fraction)
    dec.add_peer(prefill.metadata())
    good = KVTransferParams("pre", prefill.agent_name, ((2, 3),), 8, "p", page_checksums=(((tuple(sums),),),))
    dec.start_load("d", good, [[0, 1]])
    got = finish(dec, "d")
    if corrupt_fraction:
        assert got.failed == {"d": [0]} and dec.transfer_stats().corrupt == 1
    else:
        assert "d" in got.done_recving
    wrong = KVTransferParams("pre", prefill.agent_name, ((2, 3),), 8, "q", page_checksums=((((sums[0], sums[0]),),),))
    dec.start_load("w", wrong, [[2, 3]])  # as if block 3 had been reused on the prefill side
    assert finish(dec, "w").failed["w"][-1] == 3
    # Checksums for two prefill ranks from a one-rank peer: refused before any READ, every
    # block failed, and the prefill side notified so it frees at once.
    two = (((tuple(sums),),),) * 2
    dec.start_load("t", KVTransferParams("pre", prefill.agent_name, ((2, 3),), 8, "r", page_checksums=two), [[0, 1]])
    assert finish(dec, "t").failed == {"t": [0, 1]}
    assert notified(prefill, "r")
    dec.close()


def test_page_sizes_are_compared_only_between_equal_tp_sizes():
    """A rank's page holds its share of the heads: at other TP sizes the page sizes differ by
    design and are allowed; at equal sizes, or in any other field, a difference is refused."""
    here = record(tp_size=1)
    here.check(record(tp_size=2, page_bytes=PAGE // 2, attn_page_bytes=PAGE // 2), "rank-of-tp2")
    with pytest.raises(KVCompatError, match=r"page_bytes 32 \(peer\) vs 64 \(here\)"):
        here.check(record(page_bytes=PAGE // 2), "same-tp")
    with pytest.raises(KVCompatError, match=r"block_size 8 \(peer\) vs 4 \(here\)"):
        here.check(record(tp_size=2, page_bytes=PAGE // 2, block_size=8), "rank-of-tp2")


def test_a_count_whose_other_readers_never_notify_is_dropped():
    """A prefill rank read by 2 decode ranks waits for 2 notifications; one rank died mid-load,
    so one arrives. Past twice the transfer timeout the count is dropped (the lease frees the
    blocks), and a later lone notification no longer completes it. Two in time do."""
    pre = connector("pre-counted", transfer_timeout_s=0.1)
    dec = connector("dec")
    dec.add_peer(pre.metadata())
    counted = "r\x1f2"  # request r, 2 readers (kv/nixl/notif_counts.py `counted`)
    try:
        dec.send_notif(pre.agent_name, counted)
        assert not notified(pre, "r", within_s=0.5)  # over 2 x 0.1 s: dropped
        dec.send_notif(pre.agent_name, counted)
        assert not notified(pre, "r", within_s=0.5)
        dec.send_notif(pre.agent_name, "s\x1f2")
        dec.send_notif(pre.agent_name, "s\x1f2")
        assert notified(pre, "s")
    finally:
        dec.close()
        pre.close()


def test_a_read_nixl_refuses_to_build_fails_the_load(prefill):
    """Head-slice READs get their descriptors per READ; one whose remote range the peer never
    registered is refused by NIXL when the transfer is built. Nothing is in flight then, so
    the load must not end as landed: every block fails and the prefill side is told."""
    cfg = ModelConfig.from_hf_dict(nemotron_h())
    layout = plan_layout(cfg, "bfloat16", 4, BLOCKS)
    slicer = PageSlicer(cfg, 4, "bfloat16", 0, 1, tuple(g.kind for g in layout.groups))
    bufs = [torch.zeros(BLOCKS, layout.page_bytes, dtype=torch.uint8) for _ in layout.buffers]
    dec = NixlWorkerConnector("dec", bufs, layout.page_bytes, BLOCKS, slicer=slicer)
    other = connector("pre")
    real = prefill.metadata()
    # The two ranks of a TP-2 engine whose pages lie where they registered nothing.
    for rank, info in enumerate((real, other.metadata())):
        dec.add_peer(
            dataclasses.replace(
                info,
                base_addrs=(info.base_addrs[0] + (1 << 40),) * len(layout.buffers),
                page_bytes=layout.page_bytes,
                tp_rank=rank,
                tp_size=2,
                engine_agent=real.agent_name,
            )
        )
    ids = tuple(range(len(layout.groups)))
    dec.start_load("d", KVTransferParams("pre", real.agent_name, tuple((i,) for i in ids), 4, "p"), [[i] for i in ids])
    assert finish(dec, "d").failed == {"d": list(ids)}
    assert notified(prefill, "p")
    for conn in (dec, other):
        conn.close()
