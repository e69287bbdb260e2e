"""A stand-in for `worker.worker.Worker` that runs no model, for scheduler unit tests.

It keeps each request's tokens exactly as the real worker does and "samples" a token that
is a function of the whole history, so any scheduling mistake (a wrong token range, a lost
or duplicated token, a request recomputed from the wrong place) changes the output. It also
checks the block-level invariants of every step it is given.
"""

from __future__ import annotations

from concurrent.futures import Future

from engine.messages import ModelRunnerOutput, SchedulerOutput

VOCAB = 50


def next_token(history: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(history)) * 31 + len(history)) % VOCAB


class FakeWorker:
    def __init__(self, prefix_sharing: bool = False) -> None:
        self.prefix_sharing = prefix_sharing  # prefix-cache hits legitimately share blocks
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[list[int]]] = {}
        self.computed: dict[str, int] = {}
        self.zeroed: list[int] = []
        self.steps: list[SchedulerOutput] = []

    def execute_model(self, out: SchedulerOutput) -> Future[ModelRunnerOutput]:
        fut: Future[ModelRunnerOutput] = Future()
        fut.set_result(self.run(out))
        return fut

    def run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(out)
        for req_id in out.finished_req_ids:
            for d in (self.tokens, self.blocks, self.computed):
                d.pop(req_id, None)
        for new in out.new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.blocks[new.req_id] = [list(b) for b in new.block_ids]
            self.computed[new.req_id] = new.num_computed_tokens
        for c in out.cached_reqs:
            if c.resumed:
                self.blocks[c.req_id] = [list(b) for b in c.new_block_ids]
            else:
                for mine, add in zip(self.blocks[c.req_id], c.new_block_ids):
                    mine.extend(add)
            assert c.num_computed_tokens == (0 if c.resumed else self.computed[c.req_id]) or c.resumed
            self.computed[c.req_id] = c.num_computed_tokens
        self.zeroed.extend(out.new_block_ids_to_zero or [])
        owners: dict[int, str] = {}
        for req_id in () if self.prefix_sharing else out.num_scheduled_tokens:
            for group in self.blocks[req_id]:
                for b in group:
                    assert owners.setdefault(b, req_id) == req_id, f"block {b} shared in one step"
        sampled = {}
        for req_id, n in out.num_scheduled_tokens.items():
            end = self.computed[req_id] + n
            assert end <= len(self.tokens[req_id]), "scheduled tokens the worker does not know"
            self.computed[req_id] = end
            if end == len(self.tokens[req_id]):
                tok = next_token(self.tokens[req_id])
                self.tokens[req_id].append(tok)
                sampled[req_id] = tok
        return ModelRunnerOutput(out.step_id, sampled)


def reference(prompt: list[int], max_tokens: int, eos: int | None = None) -> list[int]:
    toks = list(prompt)
    out = []
    while len(out) < max_tokens:
        t = next_token(toks)
        toks.append(t)
        out.append(t)
        if t == eos:
            break
    return out
