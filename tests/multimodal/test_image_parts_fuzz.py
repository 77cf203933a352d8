"""Image parts of stored messages (Responses / Conversations items, Assistants thread messages) on
a model that takes images: any part a client may send is stored (text and pictures in order) or
refused with one 400 line naming the part, never a traceback."""

from __future__ import annotations

import base64
import io

import pytest

from ktransformers.multimodal.chat import ImageCollector
from ktransformers.multimodal.images import ImageLimits
from ktransformers.server.errors import APIError

from .conftest import photo_like


class _Support:
    """An ImageSupport without a processor: the markup and the limits are all the parts need."""

    markup = "<|vision_start|><|image_pad|><|vision_end|>"
    limits = ImageLimits(max_images=2)

    def collector(self):
        return ImageCollector(self)


def _url() -> str:
    buf = io.BytesIO()
    photo_like(20, 16).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


URL = _url()


def test_responses_item_keeps_text_and_pictures_in_order():
    from ktransformers.server.response_items import items_to_messages, normalize_items

    items = normalize_items([{"role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": URL, "detail": "low"},
        {"type": "input_text", "text": "b"}]}], images=_Support())
    parts = items[0]["content"]
    assert parts == [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": URL, "detail": "low"},
                     {"type": "input_text", "text": "b"}]
    assert items_to_messages(items)[0]["content"] == parts  # the chat prompt decodes the picture again
    with pytest.raises(APIError, match=r"content part type 'input_image' is not supported: this model takes text only"):
        normalize_items([{"role": "user", "content": [{"type": "input_image", "image_url": URL}]}])


def test_thread_image_file_part_is_refused_by_name():
    from ktransformers.server.assistants_api import _parts as thread_parts

    with pytest.raises(APIError, match=r"'content\[0\]': content part type 'image_file' is not supported: this "
                                       r"server stores no files; send an image_url part"):
        thread_parts([{"type": "image_file", "image_file": {"file_id": "file-1"}}], "content", _Support())


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402

_values = st.one_of(st.none(), st.integers(), st.text(max_size=12), st.just(URL), st.just(URL[:60]),
                    st.just("https://example.com/a.png"), st.just("file:///etc/hostname"),
                    st.just("data:text/plain;base64,aGk="), st.lists(st.integers(), max_size=2),
                    st.fixed_dictionaries({"url": st.one_of(st.just(URL), st.text(max_size=8), st.none())}))
_parts = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["input_image", "image_url", "image_file"])},
                          optional={"image_url": _values, "file_id": _values, "detail": _values}),
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "text"]), "text": _values}),
    st.dictionaries(st.sampled_from(["type", "text", "image_url"]), _values, max_size=3),
    st.text(max_size=5)), min_size=1, max_size=4)


def _one_line_400(e: APIError) -> None:
    assert e.status == 400 and "\n" not in e.message and "Traceback" not in e.message


@fuzz_settings(150, deadline=None, derandomize=True)
@given(parts=_parts)
def test_fuzz_responses_image_parts(parts):
    from ktransformers.server.response_items import normalize_items

    try:
        items = normalize_items([{"role": "user", "content": parts}], images=_Support())
    except APIError as e:
        _one_line_400(e)
    else:
        stored = items[0]["content"]
        assert all(p["type"] in ("input_text", "input_image") for p in stored)
        assert sum(p["type"] == "input_image" for p in stored) <= _Support.limits.max_images


@fuzz_settings(150, deadline=None, derandomize=True)
@given(parts=_parts)
def test_fuzz_assistants_image_parts(parts):
    from ktransformers.server.assistants_api import _parts as thread_parts

    try:
        stored = thread_parts(parts, "content", _Support())
    except APIError as e:
        _one_line_400(e)
    else:
        assert all(p["type"] in ("text", "image_url") for p in stored)
        assert all(p["image_url"]["url"] == URL for p in stored if p["type"] == "image_url")
