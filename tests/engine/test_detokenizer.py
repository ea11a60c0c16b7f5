"""IncrementalDetokenizer against the full decode of SmolLM2's real tokenizer."""
import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import load_tokenizer_from_gguf


@pytest.fixture(scope="module")
def tokenizer(bundled_gguf_path):
    return load_tokenizer_from_gguf(bundled_gguf_path)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}])


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


TEXTS = [
    "Hello world! This is a plain sentence.",
    "你好，世界。我们今天去公园散步吧！",
    "Emoji 😀🎉👍🏽 and flags 🇫🇷🇯🇵 in a row",
    "  leading spaces\n\n\tTabs\tand   runs of   spaces \n trailing ",
    "def f(x):\n    return x ** 2  # 平方 ✓\n",
    "Ünïcödé çàfé naïve — “quotes” … ½ °C",
]


def stream(tokenizer, prompt_ids, output_ids, params, chunk=1):
    """Feeds output ids `chunk` at a time; returns the streamed deltas and the stop string seen."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas = []
    for start in range(0, len(output_ids), chunk):
        stop = detok.append(output_ids[start:start + chunk])
        deltas.append(detok.stream_delta(finished=stop is not None))
        if stop is not None:
            return detok, deltas, stop
    deltas.append(detok.stream_delta(finished=True))
    return detok, deltas, None


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_full_decode(tokenizer, prompt_ids, text, chunk):
    ids = encode(tokenizer, text)
    detok, deltas, stop = stream(tokenizer, prompt_ids, ids, SamplingParams(), chunk)
    assert stop is None
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids)
    assert not any("\ufffd" in delta for delta in deltas)


def test_multibyte_characters_wait_for_their_last_byte(tokenizer, prompt_ids):
    ids = encode(tokenizer, "😀")
    assert len(ids) > 1, "the emoji should span tokens for this test to mean anything"
    _, deltas, _ = stream(tokenizer, prompt_ids, ids, SamplingParams())
    assert deltas[:len(ids) - 1] == [""] * (len(ids) - 1)
    assert deltas[len(ids) - 1] == "😀"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, prompt_ids, skip):
    ids = encode(tokenizer, "Done.<|im_end|>\n<|im_start|>user\nAgain")
    detok, deltas, _ = stream(tokenizer, prompt_ids, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.output_text) is not skip


def test_first_token_keeps_its_leading_space(tokenizer):
    prompt = encode(tokenizer, "The answer is")
    ids = encode(tokenizer, " forty two")
    detok, _, _ = stream(tokenizer, prompt, ids, SamplingParams())
    assert detok.output_text == " forty two"


def test_unknown_ids_decode_to_nothing(tokenizer, prompt_ids):
    ids = encode(tokenizer, "Hi") + [tokenizer.vocab_size + 5] + encode(tokenizer, " there")
    detok, _, _ = stream(tokenizer, prompt_ids, ids, SamplingParams())
    assert detok.output_text == "Hi there"


STOP_TEXT = "The quick brown fox jumps over the lazy dog. 你好世界 and more words after it."


@pytest.mark.parametrize("stop", ["brown fox jumps", "ox jum", "好世", "lazy dog.", "r the"])
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 4])
def test_stop_string_spanning_tokens(tokenizer, prompt_ids, stop, include, chunk):
    ids = encode(tokenizer, STOP_TEXT)
    params = SamplingParams(stop=["never there", stop], include_stop_str_in_output=include)
    detok, deltas, found = stream(tokenizer, prompt_ids, ids, params, chunk)
    cut = STOP_TEXT.index(stop)
    expected = STOP_TEXT[:cut + len(stop)] if include else STOP_TEXT[:cut]
    assert found == stop
    assert detok.output_text == expected
    assert "".join(deltas) == expected


def test_stream_never_emits_part_of_a_stop_string(tokenizer, prompt_ids):
    ids = encode(tokenizer, STOP_TEXT)
    stop = "jumps over the lazy"
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=[stop, "zzz"]))
    streamed = ""
    for token_id in ids:
        found = detok.append([token_id])
        streamed += detok.stream_delta(finished=found is not None)
        if found:
            break
        assert STOP_TEXT.startswith(streamed)
        assert "jump" not in streamed
        assert len(detok.output_text) - len(streamed) <= len(stop) - 1
    assert streamed == STOP_TEXT[:STOP_TEXT.index(stop)]


def test_earliest_stop_string_wins(tokenizer, prompt_ids):
    ids = encode(tokenizer, STOP_TEXT)
    detok, _, found = stream(tokenizer, prompt_ids, ids, SamplingParams(stop=["lazy", "quick brown fox jumps"]),
                             chunk=len(ids))
    assert found == "quick brown fox jumps"
    assert detok.output_text == "The "


def test_stop_strings_wait_for_min_tokens(tokenizer, prompt_ids):
    ids = encode(tokenizer, "yes no yes no yes")
    params = SamplingParams(stop=["yes"], min_tokens=2)
    detok, _, found = stream(tokenizer, prompt_ids, ids, params)
    assert found == "yes"
    assert detok.output_text == "yes no "
