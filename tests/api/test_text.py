"""Prompt rendering and output text: detokenizing increments, stop strings held back and cut."""

from __future__ import annotations

import pytest

from api.text import Detokenizer, StopBuffer, TemplateError, TextModel
from training.build_tokenizer import EOS_TOKEN_ID, build_tokenizer


def byte_model(template: str | None = None) -> TextModel:
    return TextModel(build_tokenizer(), template, EOS_TOKEN_ID, 2048, 258, {"eos_token": "<|endoftext|>"})


def test_detokenizer_waits_for_whole_characters_and_drops_eos():
    model = byte_model()
    ids = model.encode("héllo ✓")
    detok = Detokenizer(model, model.encode("say: "), skip_eos=True)
    pieces = [detok.push([t]) for t in ids] + [detok.push([EOS_TOKEN_ID], final=True)]
    assert "".join(pieces) == "héllo ✓"
    assert "\ufffd" not in "".join(pieces)
    assert pieces[1] == "" and pieces[2] == "é"  # é is two bytes


def test_detokenizer_flushes_a_partial_character_at_the_end():
    model = byte_model()
    detok = Detokenizer(model, [], skip_eos=True)
    assert detok.push(model.encode("é")[:1]) == ""
    assert detok.push([], final=True) == "\ufffd"


@pytest.mark.parametrize(
    "pieces, stop, expected, stopped",
    [
        (["Hello", " wor", "ld"], ("world",), "Hello ", True),
        (["ab", "cSTO", "P more"], ("STOP",), "abc", True),
        (["abc", "ST", "x"], ("STOP",), "abcSTx", False),
        (["x\n", "\nyz"], ("\n\n", "y"), "x", True),
        (["no stop here"], (), "no stop here", False),
    ],
)
def test_stop_buffer_cuts_before_the_stop_string(pieces, stop, expected, stopped):
    buf = StopBuffer(stop)
    shown = [buf.push(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert "".join(shown) == expected
    assert buf.stopped is stopped
    for i in range(len(shown)):  # what was shown so far never contains (the start of) a stop string
        assert not any(s in "".join(shown[: i + 1]) for s in stop)


def test_stop_buffer_holds_back_only_a_possible_start():
    buf = StopBuffer(("</end>",))
    assert buf.push("answer </e", final=False) == "answer "
    assert buf.push("x", final=False) == "</ex"


def test_builtin_chat_template_joins_contents():
    assert byte_model().render_chat([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb"


def test_model_chat_template_is_rendered_with_generation_prompt():
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}"
    )
    text = byte_model(template).render_chat([{"role": "user", "content": "hi"}])
    assert text == "<user>hi<assistant><|endoftext|>"


def test_template_errors_are_request_errors():
    model = byte_model("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateError, match="roles must alternate"):
        model.render_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(TemplateError):
        byte_model("{% for %}").render_chat([])
