"""An engine's outputs split among its clients (actors/output_mux.py): each client gets its own
requests' outputs in order, unowned ones go only to a client "" that asked, and a client that
stops reading has its requests aborted."""

from __future__ import annotations

import asyncio
import random

import pytest

from actors.output_mux import OutputMux, split
from engine.messages import OutputBatch, RequestOutput


def _batch(tokens: dict[str, int], finished: tuple[str, ...] = ()) -> OutputBatch:
    return OutputBatch(
        req_ids=list(tokens),
        token_ids=list(tokens.values()),
        num_prompt_tokens=[3] * len(tokens),
        num_output_tokens=[1] * len(tokens),
        others=[RequestOutput(r, [], None, "stop") for r in finished],
    )


def test_split_keeps_each_clients_outputs_in_order():
    batch = _batch({"a1": 10, "b1": 20, "a2": 11}, finished=("b1", "a1"))
    parts = split(batch, lambda r: r[0])
    assert parts["a"].req_ids == ["a1", "a2"] and parts["a"].token_ids == [10, 11]
    assert [o.req_id for o in parts["a"].others] == ["a1"]
    assert parts["b"].req_ids == ["b1"] and [o.req_id for o in parts["b"].others] == ["b1"]


def test_a_batch_of_one_client_is_passed_whole():
    batch = _batch({"a1": 1, "a2": 2})
    assert split(batch, lambda r: "a")["a"] is batch


class _Core:
    """The core's side: batches published, aborts recorded."""

    def __init__(self) -> None:
        self.published: asyncio.Queue[list[OutputBatch]] = asyncio.Queue()
        self.aborted: list[str] = []

    async def take(self) -> list[OutputBatch]:
        return await self.published.get()


def test_each_client_gets_its_requests_and_unowned_outputs_need_a_reader():
    async def main():
        core = _Core()
        mux = OutputMux(core.take, core.aborted.append)
        mux.own("a1", "A")
        mux.own("b1", "B")
        core.published.put_nowait([_batch({"a1": 1, "b1": 2, "x": 3})])
        a, b = await mux.get("A", 5), await mux.get("B", 5)
        assert [list(x.req_ids) for x in a] == [["a1"]] and [list(x.req_ids) for x in b] == [["b1"]]
        assert await mux.get("", 0.05) == []  # "x" came before client "" asked: dropped
        core.published.put_nowait([_batch({"x": 4}, finished=("a1",))])
        assert [o.req_id for x in await mux.get("A", 5) for o in x.others] == ["a1"]
        assert [list(x.req_ids) for x in await mux.get("", 5)] == [["x"]]
        await mux.close()

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_client_that_stops_reading_has_its_requests_aborted():
    async def main():
        core = _Core()
        mux = OutputMux(core.take, core.aborted.append, stale_s=0.0)
        mux.own("a1", "A")
        mux.own("b1", "B")
        core.published.put_nowait([_batch({"a1": 1})])
        while not core.aborted:
            await asyncio.sleep(0.01)
        await mux.close()
        return core.aborted

    assert asyncio.run(asyncio.wait_for(main(), 10)) == ["a1"]


def test_a_client_waiting_through_an_idle_spell_gets_the_next_outputs():
    """An output channel's pusher waits in `get` for as long as the engine is idle: the first
    output after a spell longer than `stale_s` is its, not a reason to forget it (which left the
    pusher waiting on a forgotten queue and every later request of its replica hanging)."""

    async def main():
        core = _Core()
        mux = OutputMux(core.take, core.aborted.append, stale_s=0.0)
        waiting = asyncio.create_task(mux.get("A", None))
        await asyncio.sleep(0.05)  # idle for longer than stale_s, the pusher waiting throughout
        for n in range(3):
            mux.own(f"a{n}", "A")
            core.published.put_nowait([_batch({f"a{n}": n})])  # still running
            got = await asyncio.wait_for(waiting, 5)
            assert [list(b.req_ids) for b in got] == [[f"a{n}"]]
            waiting = asyncio.create_task(mux.get("A", None))
            await asyncio.sleep(0.05)
        waiting.cancel()
        await mux.close()
        return core.aborted

    assert asyncio.run(asyncio.wait_for(main(), 10)) == []


def test_a_client_polling_after_a_pause_is_not_forgotten_on_arrival():
    """A client polling over Ray stops between requests; its last call long ago, the outputs
    of its next request are stale only once they have waited `stale_s` themselves."""

    async def main():
        core = _Core()
        mux = OutputMux(core.take, core.aborted.append, stale_s=0.2)
        mux.own("a0", "A")
        core.published.put_nowait([_batch({"a0": 0}, finished=("a0",))])
        assert [list(b.req_ids) for b in await mux.get("A", 5)] == [["a0"]]
        await asyncio.sleep(0.3)  # the client's last call is now older than stale_s
        mux.own("a1", "A")
        core.published.put_nowait([_batch({"a1": 1})])
        await asyncio.sleep(0)  # the pump takes the batch and looks for stale clients
        assert [list(b.req_ids) for b in await mux.get("A", 5)] == [["a1"]]
        await mux.close()
        return core.aborted

    assert asyncio.run(asyncio.wait_for(main(), 10)) == []


class _RunningCore(_Core):
    """A core that runs requests: each step publishes one token for every running request and
    finishes one after `length` tokens; an abort drops it (its blocks freed)."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length
        self.running: dict[str, int] = {}

    def add(self, req_id: str) -> None:
        self.running[req_id] = 0

    def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)
        self.running.pop(req_id, None)

    def step(self) -> None:
        done = [r for r, n in self.running.items() if n + 1 == self.length]
        batch = _batch({r: n for r, n in self.running.items()}, finished=tuple(done))
        for r in self.running:
            self.running[r] += 1
        for r in done:
            del self.running[r]
        self.published.put_nowait([batch])


@pytest.mark.parametrize("seed", range(20))
def test_clients_that_come_go_and_idle_lose_nothing_but_the_dead_ones_requests(seed):
    """Random traffic from pushers (clients that wait in `get`, as an output channel's does)
    with idle spells between steps and clients dying at random points, at stale_s 0: every
    request of a live client gets all its tokens in order and its finish, only requests of dead
    clients are aborted, and the core is left running nothing (every block freed)."""
    rng = random.Random(seed)

    async def main():
        core = _RunningCore(length=rng.randint(1, 4))
        mux = OutputMux(core.take, core.abort, stale_s=0.0)
        got: dict[str, list[int]] = {}
        finished: set[str] = set()
        owner: dict[str, str] = {}

        async def pusher(client: str) -> None:
            while True:
                for batch in await mux.get(client, None):
                    for r, t in zip(batch.req_ids, batch.token_ids, strict=True):
                        got.setdefault(r, []).append(t)
                    finished.update(o.req_id for o in batch.others)

        clients = {c: asyncio.create_task(pusher(c)) for c in "ABCD"}
        dead: set[str] = set()
        for step in range(60):
            for _ in range(rng.randint(0, 2)):
                client = rng.choice([c for c in clients if c not in dead])
                req_id = f"{client}{step}-{rng.random():.6f}"
                mux.own(req_id, client)
                core.add(req_id)
                owner[req_id] = client
            if len(dead) < 3 and rng.random() < 0.05:  # a replica dies: its channel's pusher ends
                client = rng.choice([c for c in clients if c not in dead])
                dead.add(client)
                clients[client].cancel()
            for _ in range(rng.randint(0, 3)):  # an idle spell: nothing published
                await asyncio.sleep(0)
            core.step()
            for _ in range(3):
                await asyncio.sleep(0)
        while core.running:  # the rest run out, or are aborted with their dead clients
            core.step()
            for _ in range(3):
                await asyncio.sleep(0)
        for task in clients.values():
            task.cancel()
        await asyncio.gather(*clients.values(), return_exceptions=True)
        await mux.close()
        return core, got, finished, owner, dead

    core, got, finished, owner, dead = asyncio.run(asyncio.wait_for(main(), 30))
    assert not core.running
    assert all(owner[r] in dead for r in core.aborted), "a live client's request was aborted"
    for req_id, client in owner.items():
        if client not in dead:
            assert got.get(req_id) == list(range(core.length)) and req_id in finished, req_id
