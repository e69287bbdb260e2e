"""The output channel on real UNIX sockets, fed by a small publisher that behaves as the engine's
`get_outputs` does (everything since the last call, waiting for the first): batches arrive in
order and whole, a second client takes over from the first without losing a batch, and an
engine end that closes fails the client's reads."""

from __future__ import annotations

import asyncio
import os

import pytest

from actors.output_channel import OutputFeed, OutputServer
from engine.messages import OutputBatch


class Publisher:
    def __init__(self) -> None:
        self._batches: list[OutputBatch] = []
        self._ready = asyncio.Event()

    def publish(self, step: int) -> None:
        self._batches.append(
            OutputBatch(req_ids=["r"], token_ids=[step], num_prompt_tokens=[1], num_output_tokens=[step])
        )
        self._ready.set()

    async def take(self) -> list[OutputBatch]:
        await self._ready.wait()
        self._ready.clear()
        out, self._batches = self._batches, []
        return out


def tokens(batches: list[OutputBatch]) -> list[int]:
    return [t for b in batches for t in b.token_ids]


async def read_until(feed: OutputFeed, n: int) -> list[int]:
    got: list[int] = []
    while len(got) < n:
        got += tokens(await feed.get(5.0))
    return got


def test_batches_arrive_in_order_and_a_quiet_engine_times_out_empty():
    async def main():
        pub = Publisher()
        server = OutputServer(pub.take)
        feed = OutputFeed(await server.open_for(os.getpid()), os.getpid())
        assert await feed.get(0.05) == []
        for step in range(50):
            pub.publish(step)
            if step % 7 == 0:
                await asyncio.sleep(0)  # some steps are pushed alone, others together
        got = await read_until(feed, 50)
        await feed.close()
        await server.close()
        return got

    assert asyncio.run(main()) == list(range(50))


def test_a_new_client_takes_over_and_no_batch_is_lost():
    async def main():
        pub = Publisher()
        server = OutputServer(pub.take)
        address = await server.open_for(os.getpid())
        first = OutputFeed(address, os.getpid())
        pub.publish(0)
        assert await read_until(first, 1) == [0]
        await first.close()  # the old API replica goes away
        while server.serving:
            await asyncio.sleep(0.01)
        pub.publish(1)  # published while no client is connected: kept for the next one
        second = OutputFeed(address, os.getpid())
        pub.publish(2)
        got = await read_until(second, 2)
        await second.close()
        await server.close()
        return got

    assert asyncio.run(main()) == [1, 2]


def test_an_engine_end_that_closes_fails_every_later_read():
    async def main():
        pub = Publisher()
        server = OutputServer(pub.take)
        feed = OutputFeed(await server.open_for(os.getpid()), os.getpid())
        pub.publish(0)
        assert await read_until(feed, 1) == [0]
        await server.close()
        for _ in range(2):
            with pytest.raises(ConnectionError, match="output channel ended"):
                await feed.get(5.0)
        await feed.close()

    asyncio.run(main())
