"""`python -m serve --model DIR --prefill 1 --decode 1` on the directories people download:
a transformers-made Qwen3.5-MoE (`Qwen3_5MoeForConditionalGeneration`, sharded, with its vision
tower and MTP weights and a `chat_template.jinja`) and a NemotronH with MoE layers, served over
HTTP by one prefill and one decode engine. Greedy completions equal transformers' `generate`,
the chat template renders as transformers renders it, and an image in a chat is a 400."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.api.test_cli import run_server, stop_server, wait_until_up
from tests.models.hf_fixtures import save_hf_model

torch.manual_seed(4)
PROMPTS = [torch.randint(2, 90, (n,)).tolist() for n in (9, 30, 17)]
NEW_TOKENS = 12
# Renders to vocabulary words only (the test tokenizer's), so its prompt is token ids too.
TEMPLATE = (
    "{%- for m in messages %}{{ 't1 ' if m.role == 'user' else 't2 ' }}{{ m.content | trim }} t3 {% endfor %}"
    "{%- if add_generation_prompt %}t4{% endif %}"
)


def _generate(ref, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "nemotron_h_moe"])
def test_served_moe_greedy_equals_transformers(tmp_path, kind):
    model_dir = tmp_path / kind
    # No EOS: `generate(min_new_tokens=...)` would mask it out of transformers' argmax.
    ref = save_hf_model(kind, model_dir, eos_token_id=None)
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    proc, url, log = run_server(tmp_path, str(model_dir), "--prefill", "1", "--decode", "1", "--worker-threads", "1")
    try:
        wait_until_up(proc, url, log)
        (card,) = httpx.get(url + "/v1/models").json()["data"]
        for ids in PROMPTS:
            r = httpx.post(
                url + "/v1/completions",
                timeout=60,
                json={
                    "model": card["id"],
                    "prompt": ids,
                    "max_tokens": NEW_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            assert r.status_code == 200, r.text
            want = " ".join(f"t{t}" for t in _generate(ref, ids))
            assert r.json()["choices"][0]["text"].split() == want.split()
        messages = [{"role": "user", "content": "t5 t6 t7"}, {"role": "assistant", "content": "t8"}]
        messages.append({"role": "user", "content": " t9 t10 "})
        from transformers import PreTrainedTokenizerFast

        hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
        rendered = hf_tok.apply_chat_template(
            messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False
        )
        chat = httpx.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={
                "model": card["id"],
                "messages": messages,
                "max_tokens": NEW_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(rendered.split())
        want = _generate(ref, [int(w[1:]) for w in rendered.split()])
        assert chat.json()["choices"][0]["message"]["content"].split() == [f"t{t}" for t in want]
        image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
        bad = httpx.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={"model": card["id"], "messages": [{"role": "user", "content": image}], "max_tokens": 2},
        )
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "messages"
        assert "image_url content is not supported" in bad.json()["error"]["message"]
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    stop_server(proc, log)
