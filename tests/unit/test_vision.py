"""Images as data: message content parts, a trajectory's image runs, the ids an engine is
sent for them, and their journal records (a gateway session rebuilt after its process
died keeps its images exactly)."""

from __future__ import annotations

import numpy as np
import pytest

from envs.tools.base import ToolResult
from envs.types import Image, Message, TerminationReason, Trajectory, TrajectoryImage
from rollout.durable import decode_content, encode_content
from rollout.engine import TokenOutput
from rollout.gateway.journal import CallCompleted, SessionJournal, read_journal, rebuild_session
from rollout.recorder import Budgets, TrajectoryRecorder
from rollout.vision import PromptIds, engine_prompt, for_engine, image_of_record, image_record

PNG = Image(b"\x89PNG fake bytes")
IMAGE_ID = 9


def placed(start: int, num_tokens: int = 4, data: bytes = b"\x89PNG a") -> TrajectoryImage:
    pixels = np.arange(2 * 3 * 2 * 2, dtype=np.float32).reshape(2, 3, 2, 2) + start
    return TrajectoryImage(start, num_tokens, Image(data), (IMAGE_ID,),
                           {"pixel_values": pixels, "pixel_attention_mask": np.ones((2, 2, 2), bool)},
                           num_image_tokens=num_tokens - 2)


def test_content_parts_are_text_or_images_and_read_either_way():
    m = Message("tool", ["Screen: ", PNG, " done"], name="screenshot")
    assert m.content == ("Screen: ", PNG, " done") and m.images == (PNG,) and m.text == "Screen:  done"
    assert m.to_template()["content"] == [{"type": "text", "text": "Screen: "}, {"type": "image"},
                                          {"type": "text", "text": " done"}]
    assert Message("user", "hi").to_template()["content"] == "hi"
    assert m.with_text("!") == ("Screen: ", PNG, " done!")
    assert Message("tool", (PNG,), name="s").with_text("!") == (PNG, "!")
    with pytest.raises(ValueError, match="text only"):
        Message("assistant", ("x", PNG))
    with pytest.raises(ValueError, match="str\\) or envs.types.Image"):
        Message("user", ("x", b"raw bytes"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty bytes"):
        Image(b"")
    assert ToolResult("Screen:", images=[PNG]).content == ("Screen:", PNG)
    assert ToolResult("plain").content == "plain"
    with pytest.raises(ValueError, match="Image.from_pil"):
        ToolResult("x", images=("not an image",))  # type: ignore[arg-type]


def test_a_journaled_content_round_trips():
    for content in ("text", ("a", PNG, "b", Image(b"jpeg", "image/jpeg"))):
        assert decode_content(encode_content(content)) == content


def _trajectory(images, mask=(0, 0, 0, 0, 0, 0, 1, 1)):
    return Trajectory("t", "g", 0, prompt_ids=[1, 2], response_ids=[3] * len(mask), response_mask=list(mask),
                      logprobs=[-0.5 if x else 0.0 for x in mask], versions=[0 if x else -1 for x in mask],
                      termination=TerminationReason.FINISHED, images=images)


def test_a_trajectory_checks_its_image_runs():
    t = _trajectory((placed(1, 3), placed(4, 3)))
    assert t.num_image_tokens == 2 and t.summary()["images"] == 2
    with pytest.raises(ValueError, match="in order"):
        _trajectory((placed(4, 3), placed(1, 3)))
    with pytest.raises(ValueError, match="inside the 10 ids"):
        _trajectory((placed(8, 3),))
    with pytest.raises(ValueError, match="never sampled"):
        _trajectory((placed(6, 3),))  # over model tokens


def test_the_engine_is_sent_each_run_as_its_placeholder():
    ids = [1, 2, 7, IMAGE_ID, IMAGE_ID, 8, 3, 7, IMAGE_ID, IMAGE_ID, 8, 4]
    images = (placed(2), placed(7, data=b"\x89PNG b"))
    sent, pictures = engine_prompt(ids, images)
    assert sent == [1, 2, IMAGE_ID, 3, IMAGE_ID, 4]
    assert [p.data for p in pictures] == [b"\x89PNG a", b"\x89PNG b"]
    assert all(not i.inputs for i in for_engine(images))  # the arrays stay with the trajectory
    with pytest.raises(ValueError, match="out of order"):
        engine_prompt(ids, images[::-1])


def test_an_image_record_round_trips_exactly():
    image = placed(5)
    back = image_of_record(image_record(image))
    assert (back.start, back.num_tokens, back.image, back.prompt_ids, back.num_image_tokens) == \
        (5, 4, image.image, (IMAGE_ID,), 2)
    for key, value in image.inputs.items():
        assert back.inputs[key].dtype == value.dtype and np.array_equal(back.inputs[key], value)


def test_the_recorder_places_the_images_ids_carry(tmp_path):
    prompt = PromptIds([1, 7, IMAGE_ID, IMAGE_ID, 8], [placed(1)])
    rec = TrajectoryRecorder("t", "g", 0, prompt, Budgets(100, 50, 10))
    rec.add_generation(TokenOutput(np.array([5, 6], np.int32), np.array([-0.1, -0.2], np.float32),
                                   np.zeros(2, np.int32), "stop", 5, 0), 0.0, 0.1)
    rec.add_observation(PromptIds([3, 7, IMAGE_ID, IMAGE_ID, 8, 4], [placed(1, data=b"\x89PNG b")]), 1, 0, 0.1)
    t = rec.finish(TerminationReason.FINISHED)
    assert [(i.start, i.image.data) for i in t.images] == [(1, b"\x89PNG a"), (8, b"\x89PNG b")]
    assert t.input_ids()[8:12].tolist() == [7, IMAGE_ID, IMAGE_ID, 8]

    # A gateway session's journal keeps them: its rebuild has the same runs and arrays.
    path = str(tmp_path / "session.journal")
    journal = SessionJournal(path)
    journal.opened("t", "g", 0)
    journal.segment_started(rec.prompt_ids, list(prompt.images))
    journal.dispatched(1, 5)
    journal.append(CallCompleted.of(TokenOutput(np.array([5, 6], np.int32), np.array([-0.1, -0.2], np.float32),
                                                np.zeros(2, np.int32), "stop", 5, 0), 0.0, 0.1, "e0", 0.0,
                                    segment=0, call=1, tool_parse_status="ok"))
    journal.observation_added(PromptIds([3, 7, IMAGE_ID, IMAGE_ID, 8, 4], [placed(1, data=b"\x89PNG b")]), 1, 0.1)
    rebuilt = rebuild_session(read_journal(path), Budgets(100, 50, 10), TerminationReason.FINISHED, "", "lost")
    (segment,) = rebuilt.segments
    assert [(i.start, i.num_tokens, i.image.data) for i in segment.images] == \
        [(i.start, i.num_tokens, i.image.data) for i in t.images]
    assert np.array_equal(segment.images[1].inputs["pixel_values"], t.images[1].inputs["pixel_values"])
