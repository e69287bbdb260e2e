"""--kv-verify on the scheduler side: a prefill worker's checksums become the hand-over's
`page_checksums`, block for block, and a decode load carries exactly the slice it reads."""

from __future__ import annotations

import dataclasses

import pytest

from engine.messages import ModelRunnerOutput, SamplingParams
from engine.request import Request
from kv.nixl.transfer_params import KVTransferParams
from tests.engine.test_pd import add, decode_scheduler, remote
from tests.engine.test_pd_leases import prefill_scheduler


def hand_over(checksums: list[list[list[list[int]]]] | None) -> KVTransferParams:
    s = prefill_scheduler([0.0])
    s.add_request(
        Request("x", list(range(9)), SamplingParams(max_tokens=1, temperature=0), None, do_remote_decode=True)
    )
    out = s.schedule()
    kv_checksums = {} if checksums is None else {"x": checksums}
    (done,) = s.update_from_output(out, ModelRunnerOutput(out.step_id, {"x": 1}, kv_checksums=kv_checksums))
    return done.kv_transfer_params


def test_checksums_travel_with_the_hand_over_block_for_block():
    # 9 tokens in blocks of 4: 3 attention blocks, 1 state; two prefill ranks x two decode ranks.
    table = [[[[11, 12, 13], [99]], [[0, 0, 0], [0]]], [[[0, 0, 0], [0]], [[21, 22, 23], [98]]]]
    params = hand_over(table)
    assert params.page_checksums == (
        (((11, 12, 13), (99,)), ((0, 0, 0), (0,))),
        (((0, 0, 0), (0,)), ((21, 22, 23), (98,))),
    )
    assert len(params.remote_block_ids[0]) == 3 and hand_over(None).page_checksums is None
    with pytest.raises(RuntimeError, match="checksummed other blocks"):
        hand_over([[[[11, 12], [99]]]])
    with pytest.raises(RuntimeError, match="checksummed other blocks"):
        hand_over([[[[11, 12, 13], [99]]], [[[11, 12], [99]]]])  # one rank's table short


def test_a_load_carries_the_checksums_of_the_blocks_it_reads():
    s = decode_scheduler()
    sums = ((((1, 2, 3), (4,)),),)
    add(s, "d", list(range(10)), dataclasses.replace(remote("d", 9), page_checksums=sums))
    (load,) = s.schedule().kv_connector_meta.loads
    assert load.params.page_checksums == sums
