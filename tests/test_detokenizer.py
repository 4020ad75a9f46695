"""IncrementalDetokenizer on the default model's vocabulary: UTF-8 safety, stop strings, streaming."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.detokenizer import IncrementalDetokenizer
from scheduler.model_files import find_default_model
from scheduler.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(find_default_model())


def stream(
    tok: Tokenizer, ids: Sequence[int], stop: Sequence[str] = (), **kwargs: object
) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Every push's output, the flush output, and the detokenizer."""
    detok = IncrementalDetokenizer(tok, stop=stop, **kwargs)  # type: ignore[arg-type]
    pushed = [detok.push(token_id) for token_id in ids]
    return pushed, detok.flush(), detok


def cut_at_first_stop(text: str, stops: Sequence[str]) -> str:
    """Reference: the text before the stop-string occurrence that ends first (longer wins ties)."""
    for end in range(1, len(text) + 1):
        ending_here = [s for s in stops if s and text.endswith(s, 0, end)]
        if ending_here:
            return text[: end - max(len(s) for s in ending_here)]
    return text


def test_plain_text_streams_token_by_token(tok: Tokenizer) -> None:
    ids = tok.encode(" the cat sat on the mat")
    pushed, flushed, detok = stream(tok, ids)
    assert pushed == [" the", " cat", " sat", " on", " the", " mat"]
    assert flushed == ""
    assert not detok.stopped and detok.matched_stop is None


def test_character_split_across_tokens_is_held_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("I 🤖 you")
    assert tok.convert_ids_to_tokens(ids) == ["I", "ĠðŁ", "¤", "ĸ", "Ġyou"]
    pushed, flushed, _ = stream(tok, ids)
    assert pushed == ["I", "", "", " 🤖", " you"]
    assert flushed == ""


def test_cjk_split_across_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("naïve 世界 café")
    pushed, _, _ = stream(tok, ids)
    assert pushed == ["na", "ïve", " ", "", "世", "", "", "界", " café"]
    assert not any("\ufffd" in chunk for chunk in pushed)


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🤖")[:-1]
    pushed, flushed, _ = stream(tok, ids)
    assert "".join(pushed) == "ok"
    assert flushed == tok.decode(ids)[len("ok") :]
    assert flushed.endswith("\ufffd")


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert stream(tok, ids)[0] == ["", "hi", ""]
    assert stream(tok, ids, skip_special_tokens=False)[0] == ["<|im_start|>", "hi", "<|im_end|>"]


def test_prefix_ids_give_context_but_are_not_returned(tok: Tokenizer) -> None:
    prompt = tok.encode("Say hello")
    ids = tok.encode(" world and 🤖")
    pushed, flushed, _ = stream(tok, ids, prefix_token_ids=prompt[-2:])
    assert "".join(pushed) + flushed == " world and 🤖"
    assert pushed[0] == " world"


def test_stop_string_spanning_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(" the cat sat on the mat")
    pushed, flushed, detok = stream(tok, ids, stop=["at on th"])
    # " cat" and " sat" end in "at", which may start the stop string, so "at" is held back each time;
    # "at on" is held whole, and " the" completes the stop string inside "sat on the".
    assert pushed == [" the", " c", "at s", "", "", ""]
    assert flushed == ""
    assert detok.stopped and detok.matched_stop == "at on th"


def test_held_text_is_released_when_the_stop_string_does_not_follow(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world peace")
    pushed, flushed, detok = stream(tok, ids, stop=["world!"])
    assert pushed == ["Hello", " ", "world peace"]
    assert flushed == ""
    assert not detok.stopped


def test_held_text_is_released_by_flush(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world")
    pushed, flushed, detok = stream(tok, ids, stop=["world!"])
    assert pushed == ["Hello", " "]
    assert flushed == "world"
    assert not detok.stopped


def test_stop_string_at_the_very_start(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world")
    pushed, flushed, detok = stream(tok, ids, stop=["Hel"])
    assert pushed == ["", ""]
    assert flushed == ""
    assert detok.stopped and detok.matched_stop == "Hel"


def test_stop_string_completed_by_flush(tok: Tokenizer) -> None:
    ids = tok.encode("a🤖")
    detok = IncrementalDetokenizer(tok, stop=["\ufffd"])
    pushed = [detok.push(i) for i in ids[:-1]]
    assert pushed == ["a"] + [""] * (len(ids) - 2)
    assert detok.flush() == ""
    assert detok.stopped and detok.matched_stop == "\ufffd"


def test_overlapping_stop_strings_first_to_end_wins(tok: Tokenizer) -> None:
    ids = tok.encode(" the cat sat on")
    # "cat sat on" starts first but "at s" ends first: generation would have stopped there.
    pushed, _, detok = stream(tok, ids, stop=["cat sat on", "at s"])
    assert "".join(pushed) == " the c"
    assert detok.matched_stop == "at s"
    # Both end at the same character: the longer one is the match.
    pushed, _, detok = stream(tok, tok.encode(" she sat"), stop=["at", "sat"])
    assert "".join(pushed) == " she "
    assert detok.matched_stop == "sat"
    # One stop string is a prefix of the other: the shorter completes first.
    pushed, _, detok = stream(tok, tok.encode(" the cat sat"), stop=["cat sat", "cat"])
    assert "".join(pushed) == " the "
    assert detok.matched_stop == "cat"


def test_nothing_after_a_stop_is_returned(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["cat"])
    outputs = [detok.push(i) for i in tok.encode(" the cat sat on the mat")]
    assert outputs == [" the", " ", "", "", "", ""]
    assert detok.stopped
    assert [detok.push(i) for i in tok.encode(" more text")] == ["", ""]
    assert detok.flush() == ""


def test_empty_stop_string_is_rejected(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"stop\[1\] is empty"):
        IncrementalDetokenizer(tok, stop=["ok", ""])


class CountingTokenizer:
    """Stands in for a Tokenizer and counts how many ids the detokenizer asks it to decode."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.special_token_ids = inner.special_token_ids
        self.decoded_ids = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_does_not_grow_with_the_output(tok: Tokenizer) -> None:
    ids = tok.encode(" word" * 300 + " 世界🤖" * 50)
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, stop=["never appears"])  # type: ignore[arg-type]
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert counting.decoded_ids <= 8 * len(ids)


# Byte-fragment tokens (decode alone to U+FFFD) make split characters and invalid UTF-8 common.
def _fragment_ids(tok: Tokenizer) -> list[int]:
    return [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]


@st.composite
def token_streams(draw: st.DrawFn, tok: Tokenizer, fragments: list[int]) -> list[int]:
    any_token = st.integers(min_value=0, max_value=tok.vocab_size - 1)
    fragment = st.sampled_from(fragments)
    pieces = st.one_of(any_token, fragment, st.sampled_from(sorted(tok.special_token_ids)))
    return draw(st.lists(pieces, max_size=30))


@st.composite
def stop_strings(draw: st.DrawFn, text: str) -> list[str]:
    """A mix of substrings of the text (so stops really occur) and short arbitrary strings."""
    stops = []
    for _ in range(draw(st.integers(0, 3))):
        if text and draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            stops.append(text[start : start + draw(st.integers(1, 6))])
        else:
            stops.append(draw(st.text(alphabet="ab \ufffd", min_size=1, max_size=3)))
    return stops


@pytest.fixture(scope="module")
def fragments(tok: Tokenizer) -> list[int]:
    found = _fragment_ids(tok)
    assert len(found) > 100
    return found


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip_special=st.booleans())
def test_streamed_text_equals_full_decode_cut_at_stop(
    tok: Tokenizer, fragments: list[int], data: st.DataObject, skip_special: bool
) -> None:
    ids = data.draw(token_streams(tok, fragments))
    full = tok.decode(ids, skip_special_tokens=skip_special)
    stops = data.draw(stop_strings(full))
    pushed, flushed, detok = stream(tok, ids, stop=stops, skip_special_tokens=skip_special)
    expected = cut_at_first_stop(full, stops)
    assert "".join(pushed) + flushed == expected
    # Equality also means no chunk sent U+FFFD for a character whose bytes came later.
    assert detok.stopped == any(s in full for s in stops)
    if detok.stopped:
        assert detok.matched_stop in stops
        assert full[len(expected) :].startswith(detok.matched_stop)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), text=st.text(max_size=40))
def test_streamed_text_of_encoded_text_never_breaks_characters(
    tok: Tokenizer, data: st.DataObject, text: str
) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=False)
    stops = data.draw(stop_strings(full))
    pushed, flushed, _ = stream(tok, ids, stop=stops, skip_special_tokens=False)
    assert "".join(pushed) + flushed == cut_at_first_stop(full, stops)
    # (When full != text the vocabulary lacks a byte, e.g. 0xF1, and the tokenizer dropped it.)
    if full == text and "\ufffd" not in text:
        assert not any("\ufffd" in chunk for chunk in [*pushed, flushed])
