"""What the channels' frames let through: raypd's message dataclasses and exceptions, built as
they were sent; a pickle that names anything else is refused; and a channel end accepts or
keeps only the process it was opened for."""

from __future__ import annotations

import asyncio
import os
import pickle

import pytest

from actors.output_channel import OutputFeed, OutputServer
from actors.socket_frames import PeerRefusedError, connected_socket, frame, listening_socket, loads, read_frame
from actors.step_channel import StepChannel, StepServer, WorkerLostError
from engine.core import EngineCore
from engine.messages import (
    CachedRequestData,
    InvalidRequestError,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    OutputBatch,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
)
from kv.nixl.scheduler import ConnectorMetadata, LoadSpec
from kv.nixl.transfer_params import KVTransferParams


def through(obj: object) -> object:
    _, body = frame(obj)
    return loads(body)


def test_the_messages_come_through_as_sent():
    params = KVTransferParams("pre-0", "agent", ((1, 2), (3,)), 17, "req-p", expires_at=5.0)
    step = SchedulerOutput(
        7,
        [
            NewRequestData(
                "a",
                [1, 2, 3],
                SamplingParams(max_tokens=4, temperature=0.5, logit_bias=((3, 1.5),), stop_token_ids=(7,), min_p=0.1),
                [[1], [2]],
                0,
                scored_tail=(4,),
            )
        ],
        [CachedRequestData("b", 9, [[4], []], resumed=True)],
        {"a": 3, "b": 1},
        ["c"],
        [5, 6],
        ConnectorMetadata((LoadSpec("a", params, ((1, 2), (3,))),), (("agent", "req-q"),)),
    )
    result = ModelRunnerOutput(
        7,
        {"a": 11},
        {"a": -0.5},
        failed_loads={"x": [1]},
        failed_reqs={"y": "bad"},
        top_logprobs={"a": [(11, -0.5), (3, -1.5)]},
        prompt_logprobs={"a": Logprobs(1, [-2.0, -0.25], [[(4, -0.1)], [(5, -0.2)]])},
    )
    scored = RequestOutput(
        "b", [2], [-0.5], "stop", 9, 2, top_logprobs=[[(2, -0.5)]], prompt_logprobs=Logprobs(1, [], [])
    )
    batch = OutputBatch(["a"], [11], [3], [1], [scored])
    for message in (step, result, [batch, OutputBatch()], (False, InvalidRequestError("no", param="n"))):
        assert through(message) == message or repr(through(message)) == repr(message)
    error = through(InvalidRequestError("bad top_k", param="top_k"))
    assert isinstance(error, InvalidRequestError) and error.param == "top_k"
    assert isinstance(through(ValueError("x")), ValueError)


class Payload:
    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize(
    "payload",
    [Payload(os.system, "true"), Payload(eval, "1"), Payload(EngineCore, None, [], True, None), Payload(dict)],
    ids=["os.system", "eval", "a class that is no message", "a builtin that is no exception"],
)
def test_a_pickle_naming_anything_else_is_refused(payload):
    with pytest.raises(pickle.UnpicklingError, match="may not name"):
        loads(pickle.dumps(payload))


def test_a_step_server_refuses_another_process_and_reads_nothing_from_it():
    async def main():
        ran = []
        server = StepServer(lambda out: ran.append(out), lambda result: result)
        address = await server.listen(engine_pid=os.getpid() + 100_000)  # no such engine here
        channel = StepChannel(address, os.getpid())  # the server is this process: the client's check passes
        with pytest.raises(WorkerLostError):
            await asyncio.wait_for(channel(SchedulerOutput(0, [], [], {}, [], None)), 5)
        await channel.close()
        server.close()
        return ran

    assert asyncio.run(main()) == []


def test_a_client_refuses_a_server_that_is_not_the_process_named():
    async def main():
        server = OutputServer(asyncio.Event().wait)
        address = await server.open_for(os.getpid())
        with pytest.raises(PeerRefusedError, match="not one of"):
            connected_socket(address, os.getpid() + 100_000)
        await server.close()

    asyncio.run(main())


def test_an_output_server_pushes_nothing_to_a_process_it_was_not_opened_for():
    async def main():
        server = OutputServer(asyncio.Event().wait)
        address = await server.open_for(os.getpid() + 100_000)
        feed = OutputFeed(address, os.getpid())
        with pytest.raises(ConnectionError, match="output channel ended"):
            await feed.get(5.0)
        assert not server.serving
        await feed.close()
        await server.close()

    asyncio.run(main())


def test_a_reply_the_engine_cannot_read_fails_the_step_instead_of_hanging():
    async def main():
        async def answer_badly(reader, writer):
            await read_frame(reader)
            writer.writelines(frame(Payload(os.system, "true")))

        sock, address = listening_socket("steps")
        server = await asyncio.start_unix_server(answer_badly, sock=sock)
        channel = StepChannel(address, os.getpid())
        with pytest.raises(WorkerLostError, match=r"step channel broke.*may not name"):
            await asyncio.wait_for(channel(SchedulerOutput(0, [], [], {}, [], None)), 5)
        with pytest.raises(WorkerLostError):
            await channel(SchedulerOutput(1, [], [], {}, [], None))
        await channel.close()
        server.close()

    asyncio.run(main())
