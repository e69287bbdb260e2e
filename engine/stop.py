"""Stop conditions checked when a sampled token is reported: EOS, max_tokens, the model's
length limit, and stop strings (found in the detokenized output, so they work across
token boundaries)."""

from __future__ import annotations

from tokenizers import Tokenizer

from engine.request import Request


class StopChecker:
    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def check(self, req: Request) -> str | None:
        """The finish reason after the request's newest output token, or None to go on."""
        params = req.sampling
        outputs = req.output_token_ids
        last = outputs[-1]
        if last == req.eos_token_id and not params.ignore_eos:
            return "stop"
        if params.stop_token_ids and last in params.stop_token_ids:
            return "stop"  # the token stays in the output ids; the API shows no text for it, as vLLM
        if params.stop and self._hit_stop_string(req):
            return "stop"
        num_outputs = len(outputs)  # `num_tokens` spelled out: this runs for every sampled token
        if num_outputs >= params.max_tokens or req.num_prompt_tokens + num_outputs >= self.max_model_len:
            return "length"
        return None

    def plain_limits(self, req: Request) -> tuple[int, int] | None:
        """For a request without stop strings, what `check` reduces to: (the output count at
        which it answers "length", the token id it answers "stop" for, -1 for none); None when
        every token needs the full check."""
        params = req.sampling
        if params.stop or params.stop_token_ids:
            return None
        until = min(params.max_tokens, self.max_model_len - req.num_prompt_tokens)
        stop_id = -1 if params.ignore_eos or req.eos_token_id is None else req.eos_token_id
        return until, stop_id

    def _hit_stop_string(self, req: Request) -> bool:
        if self.tokenizer is None:
            return False
        # Only the tail can contain a stop string that the newest token completed; as in vLLM,
        # none counts in the text of the first `min_tokens` outputs.
        outputs = req.output_token_ids
        longest = max(len(s) for s in req.sampling.stop)
        start = max(len(outputs) - (longest + 8), req.sampling.min_tokens)
        if start >= len(outputs):
            return False
        tail = self.tokenizer.decode(outputs[start:], skip_special_tokens=False)
        return any(s in tail for s in req.sampling.stop)


def truncate_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """The text before the first stop string, as OpenAI's API returns it."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]
