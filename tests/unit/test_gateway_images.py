"""Images through the gateway: OpenAI `image_url` parts (base64 data URLs) and Anthropic
base64 `image` blocks become envs.types.Image parts of the message content, in order with
the text and with the bytes as sent; URLs (fetching), bad base64, non-image types,
undecodable bytes and oversized images are refused with a 400 naming the part; an image
is decoded once however often a harness re-sends it. Segments
compare images by content: the same image re-sent extends the segment, a changed earlier
image starts a new one (on the tiny vision-language model's continuity builder, a fake
engine); a text model refuses a request with images and keeps its session.
"""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image as PILImage

from envs.types import Image, Message, TerminationReason
from rollout.engine import TokenOutput
from rollout.gate import TurnGate
from rollout.gateway.protocol import (MAX_IMAGE_PIXELS, ProtocolError, extension_suffix, parse_anthropic_request,
                                      parse_openai_request)
from rollout.gateway.server import Gateway, GatewaySettings
from rollout.recorder import Budgets
from rollout.router import Router


def encoded(color: tuple[int, int, int], size: tuple[int, int] = (40, 30), fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    PILImage.new("RGB", size, color).save(buffer, format=fmt)
    return buffer.getvalue()


RED, BLUE = encoded((200, 10, 10)), encoded((10, 10, 200))
JPEG = encoded((10, 200, 10), fmt="JPEG")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def openai_image(data: bytes, media_type: str = "image/png", **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{b64(data)}", **extra}}


def anthropic_image(data: bytes, media_type: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": b64(data)}}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


# -- parsing -----------------------------------------------------------------------------------
def test_openai_image_parts_become_images_in_order():
    body = {"messages": [
        {"role": "system", "content": [text("Be "), text("brief.")]},
        {"role": "user", "content": [text("Look: "), openai_image(RED, detail="high"), text("and "), text("this "),
                                     openai_image(JPEG, "image/jpeg")]},
        {"role": "assistant", "content": [text("Calling.")],
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [openai_image(BLUE), text("the screen")]},
    ]}
    system, user, assistant, tool = parse_openai_request(body).messages
    assert system.content == "Be brief." and assistant.content == "Calling."  # text only: one string, as before
    assert user.content == ("Look: ", Image(RED, "image/png"), "and this ", Image(JPEG, "image/jpeg"))
    assert [i.data for i in user.images] == [RED, JPEG]
    assert tool.content == (Image(BLUE, "image/png"), "the screen") and tool.name == "shot"


def test_anthropic_image_blocks_become_images_in_order():
    body = {"max_tokens": 8, "messages": [
        {"role": "user", "content": [text("Compare "), anthropic_image(RED), text(" with "),
                                     anthropic_image(JPEG, "image/jpeg")]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [text("screen: "), anthropic_image(BLUE)]},
            anthropic_image(RED), text("What now?")]},
    ]}
    first, _, tool, after = parse_anthropic_request(body).messages
    assert first.content == ("Compare ", Image(RED), " with ", Image(JPEG, "image/jpeg"))
    assert tool.role == "tool" and tool.name == "shot" and tool.content == ("screen: ", Image(BLUE))
    # The image and text beside the tool result: a user message after it, in their order.
    assert after.role == "user" and after.content == (Image(RED), "What now?")


def test_an_image_alone_is_a_user_message():
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": [anthropic_image(RED)]}]}
    (message,) = parse_anthropic_request(body).messages
    assert message.content == (Image(RED),) and message.text == ""


TRUNCATED = RED[:len(RED) // 2]
NOT_AN_IMAGE = b"plain text, not an image"


@pytest.mark.parametrize("part, param, reason, words", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "image_url.url", "unsupported",
     "data URL"),
    ({"type": "image_url", "image_url": {"url": "http://10.0.0.1/x.png"}}, "image_url.url", "unsupported",
     "not fetched"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "image_url.url", "invalid", "data URL"),
    ({"type": "image_url", "image_url": {"url": "data:image/png,%89PNG"}}, "image_url.url", "invalid", "base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}}, "image_url.url", "invalid",
     "not valid base64"),
    ({"type": "image_url", "image_url": {"url": "data:text/plain;base64," + b64(RED)}}, "image_url.url",
     "invalid", "not an image type"),
    (openai_image(NOT_AN_IMAGE), "image_url.url", "invalid", "cannot be decoded"),
    (openai_image(TRUNCATED), "image_url.url", "invalid", "cannot be decoded"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}, "image_url.url", "invalid", "empty"),
    ({"type": "image_url", "image_url": {}}, "image_url.url", "invalid", "required"),
    ({"type": "image_url", "image_url": "data:image/png;base64,xx"}, "image_url", "invalid", "an object"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(RED), "detail": 1}},
     "image_url.detail", "invalid", "a string"),
    ({"type": "input_audio", "input_audio": {}}, "type", "unsupported", "audio"),
])
def test_bad_openai_image_parts_are_refused_naming_the_part(part, param, reason, words):
    body = {"messages": [{"role": "user", "content": [text("See"), part]}]}
    with pytest.raises(ProtocolError) as refused:
        parse_openai_request(body)
    err = refused.value
    assert err.status == 400 and err.reason.value == reason and words in err.message, err.message
    assert err.param == f"messages[0].content[1].{param}" and err.param in err.message


@pytest.mark.parametrize("role", ["system", "assistant"])
def test_openai_images_only_where_the_api_takes_them(role):
    body = {"messages": [{"role": role, "content": [openai_image(RED)]}, {"role": "user", "content": "x"}]}
    with pytest.raises(ProtocolError, match=f"{role} messages take text parts only") as refused:
        parse_openai_request(body)
    assert refused.value.param == "messages[0].content[0].type"


def anthropic_refusal(content: list, where: str = "messages.0.content") -> ProtocolError:
    with pytest.raises(ProtocolError) as refused:
        parse_anthropic_request({"max_tokens": 8, "messages": [{"role": "user", "content": content}]})
    assert refused.value.status == 400 and where in refused.value.message, refused.value.message
    return refused.value


@pytest.mark.parametrize("source, where, reason, words", [
    ({"type": "url", "url": "https://example.com/cat.png"}, "0.source.type", "unsupported", "base64"),
    ({"type": "file", "file_id": "file_1"}, "0.source.type", "unsupported", "fetches nothing"),
    ({"type": "base64", "media_type": "image/bmp", "data": b64(RED)}, "0.source.media_type", "invalid", "image/png"),
    ({"type": "base64", "media_type": "text/plain", "data": b64(RED)}, "0.source.media_type", "invalid",
     "image/png"),
    ({"type": "base64", "media_type": "image/png", "data": "not base64!"}, "0.source.data", "invalid",
     "not valid base64"),
    ({"type": "base64", "media_type": "image/png", "data": b64(NOT_AN_IMAGE)}, "0.source.data", "invalid",
     "cannot be decoded"),
    ({"type": "base64", "media_type": "image/png"}, "0.source.data", "invalid", "required"),
    ({}, "0.source.type", "invalid", "required"),
])
def test_bad_anthropic_image_blocks_are_refused_naming_the_block(source, where, reason, words):
    err = anthropic_refusal([{"type": "image", "source": source}], f"messages.0.content.{where}")
    assert err.reason.value == reason and words in err.message, err.message


def test_anthropic_images_in_tool_results_are_checked_too():
    bad = {"type": "image", "source": {"type": "url", "url": "https://example.com/x.png"}}
    with pytest.raises(ProtocolError, match=r"messages\.2\.content\.0\.content\.1\.source\.type") as refused:
        parse_anthropic_request({"max_tokens": 8, "messages": [
            {"role": "user", "content": "Go."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [text("x"), bad]}]},
        ]})
    assert refused.value.reason.value == "unsupported"


@pytest.mark.parametrize("place, body", [
    ("system", {"system": [anthropic_image(RED)], "messages": [{"role": "user", "content": "x"}]}),
    ("assistant", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        anthropic_image(RED)]}, {"role": "user", "content": "y"}]}),
])
def test_anthropic_images_only_in_user_content_and_tool_results(place, body):
    with pytest.raises(ProtocolError, match=f"image blocks are not allowed in {place} content"):
        parse_anthropic_request({"max_tokens": 8, **body})


def test_oversized_images_are_refused():
    with pytest.raises(ProtocolError, match=rf"is {len(RED)} bytes; at most {len(RED) - 1} bytes") as refused:
        parse_openai_request({"messages": [{"role": "user", "content": [openai_image(RED)]}]},
                             max_image_bytes=len(RED) - 1)
    assert refused.value.param == "messages[0].content[0].image_url.url"
    assert parse_openai_request({"messages": [{"role": "user", "content": [openai_image(RED)]}]},
                                max_image_bytes=len(RED)).messages[0].images == (Image(RED),)
    # A few KiB of PNG declaring more pixels than the cap: refused from its header.
    buffer = io.BytesIO()
    PILImage.new("1", (7681, 4321)).save(buffer, format="PNG")
    assert 7681 * 4321 > MAX_IMAGE_PIXELS and len(buffer.getvalue()) < 2**20
    err = anthropic_refusal([anthropic_image(buffer.getvalue())], "messages.0.content.0.source.data")
    assert "7681x4321 pixels" in err.message


def test_an_image_is_decoded_once_however_often_it_is_resent(monkeypatch):
    """Harnesses re-send their whole history every turn: an image that decoded before is
    known by its digest; one that failed is refused every time."""
    opened = []
    real_open = PILImage.open
    monkeypatch.setattr(PILImage, "open", lambda *a, **k: opened.append(1) or real_open(*a, **k))
    fresh = encoded((1, 2, 3), (17, 19))  # in no other test: not remembered yet
    body = {"messages": [{"role": "user", "content": [openai_image(fresh)]}]}
    for _ in range(3):
        assert parse_openai_request(body).messages[0].images == (Image(fresh),)
    assert len(opened) == 1
    bad = {"messages": [{"role": "user", "content": [openai_image(fresh[:len(fresh) // 2])]}]}
    for _ in range(2):
        with pytest.raises(ProtocolError, match="cannot be decoded"):
            parse_openai_request(bad)
    assert len(opened) == 3


def test_extension_compares_images_by_content():
    """Each request is parsed anew, so its images are new objects: equal bytes extend."""
    def request(first: bytes, *more: dict) -> tuple[Message, ...]:
        return parse_openai_request({"messages": [
            {"role": "user", "content": [text("Look"), openai_image(first)]}, *more]}).messages

    previous, reply = request(RED), Message("assistant", "A red box.")
    more = ({"role": "assistant", "content": "A red box."}, {"role": "user", "content": [openai_image(BLUE)]})
    assert extension_suffix(previous, reply, [], request(RED, *more), []) == (Message("user", (Image(BLUE),)),)
    assert extension_suffix(previous, reply, [], request(BLUE, *more), []) is None  # an earlier image changed


# -- segments on the tiny vision-language model ------------------------------------------------
class FakeEngine:
    """A fake engine: each generation is `reply` + the stop token; it records the prompts."""

    def __init__(self, tokenizer, stop_id: int, reply: str = "A box.") -> None:
        self.ids = tokenizer.encode(reply, add_special_tokens=False) + [stop_id]
        self.prompts: list[list[int]] = []

    async def generate(self, request_id, prompt_ids, sampling, **_):
        self.prompts.append([int(i) for i in prompt_ids])
        n = len(self.ids)
        await asyncio.sleep(0)
        return TokenOutput(np.array(self.ids, np.int32), np.full(n, -0.5, np.float32), np.zeros(n, np.int32),
                           "stop", len(prompt_ids), 0)


@pytest.fixture(scope="module")
def vl_chat():
    from transformers import AutoTokenizer

    from rollout.chat import build_continuity_builder
    from rollout.vision import load_image_expander
    from trainer.run.tiny_vl_model import ensure_tiny_vl_model

    path = ensure_tiny_vl_model()
    return build_continuity_builder(AutoTokenizer.from_pretrained(path), images=load_image_expander(path),
                                    reasoning_parser="none")


def gateway_on(chat) -> tuple[Gateway, FakeEngine]:
    engine = FakeEngine(chat.tokenizer, chat.end_of_turn_id)
    gateway = Gateway(Router({"e0": engine}), TurnGate(), chat, chat.tokenizer,
                      GatewaySettings("policy", Budgets(4096, 2048, 8)))
    return gateway, engine


async def ask(gateway: Gateway, session, messages: list[dict]) -> dict:
    """One request (tool_choice none: the reply is the decoded text); the assistant message."""
    reply = await gateway.complete(session, parse_openai_request({"messages": messages, "tool_choice": "none"}))
    return {"role": "assistant", "content": reply.content}


async def test_same_image_extends_and_a_changed_image_starts_a_segment(vl_chat):
    gateway, engine = gateway_on(vl_chat)
    session = gateway.open_session("task", "g", 0)
    history = [{"role": "user", "content": [text("What is this?"), openai_image(RED)]}]
    history.append(await ask(gateway, session, history))
    # The same image, re-encoded by the harness on every request, and a new one after.
    history.append({"role": "user", "content": [text("And now?"), openai_image(RED), openai_image(BLUE)]})
    history.append(await ask(gateway, session, history))
    assert gateway.stats().num_prefix_breaks == 0 and len(engine.prompts) == 2
    assert engine.prompts[1][:len(engine.prompts[0])] == engine.prompts[0]  # appended, nothing re-encoded
    # The harness swaps the first image (a re-taken screenshot): a new segment.
    changed = [{"role": "user", "content": [text("What is this?"), openai_image(BLUE)]}, *history[1:]]
    await ask(gateway, session, [*changed, {"role": "user", "content": "Sure?"}])
    first, second = gateway.close_session(session.id, TerminationReason.FINISHED)
    assert gateway.stats().num_prefix_breaks == 1 and len(first.turns) == 2 and len(second.turns) == 1
    assert [i.image.data for i in first.images] == [RED, RED, BLUE]
    assert [i.image.data for i in second.images] == [BLUE, RED, BLUE]
    ids = np.concatenate([first.prompt_ids, first.response_ids])
    for image in first.images:  # each run is the processor's expansion, where the recorder put it
        run, _ = vl_chat.images.process(image.image)
        assert ids[image.start:image.end].tolist() == run


async def test_images_for_a_text_model_fail_that_request_only(chat):
    gateway, engine = gateway_on(chat)
    session = gateway.open_session("task", "g", 0)
    history = [{"role": "user", "content": "Hi."}]
    history.append(await ask(gateway, session, history))
    with pytest.raises(ProtocolError, match="takes no images") as refused:
        await ask(gateway, session, [*history, {"role": "user", "content": [text("See"), openai_image(RED)]}])
    assert refused.value.status == 400 and gateway.stats().errors_by_reason == {"invalid": 1}
    # The session goes on where it was: the next text turn extends the same segment.
    history.append({"role": "user", "content": "Text, then."})
    await ask(gateway, session, history)
    (segment,) = gateway.close_session(session.id, TerminationReason.FINISHED)
    assert len(segment.turns) == 2 and gateway.stats().num_prefix_breaks == 0 and len(engine.prompts) == 2
