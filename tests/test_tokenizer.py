"""Tokenizer parity with transformers on the default model's GGUF, HF-directory loading, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from scheduler.model_files import find_default_model
from scheduler.tokenizer import Tokenizer, TokenizerLoadError, load_tokenizer
from tests.transformers_reference import gguf_tokenizer

# Text on which the GGUF tokenizer must give exactly transformers' ids.
PARITY_TEXTS = [
    "",
    "Hello world",
    "Hello, World! How are you doing today?",
    "   leading spaces and trailing   ",
    "tabs\tand\nnewlines\r\n\n\nand  double  spaces",
    "      ",
    "\n",
    "digits 0123456789 and 3.14159, 1,000,000; x=42",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum\n",
    'if (x != y && z >= 0) { printf("%d\\n", z); }',
    "emoji 🤖👍🏽 and flags 🇫🇷 and ZWJ 👨‍👩‍👧",
    "中文分词测试，日本語のテキスト、한국어 텍스트",
    "naïve café résumé Ångström über façade",
    "Ελληνικά и русский текст",
    "I'm sure they've said we'll see what's what",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <repo_name>x<file_sep>",
    "<|im_start|><|im_end|><|im_start|>",
    "not a special <|im_start |> token",
    "∑ ∫ √ ≠ ≤ ∞ ← → ©®™ \u00a0nbsp \u200b zero-width",
]

# Whitespace runs before a digit: `tokenizer.ggml.pre = "smollm"` (llama.cpp, and the SmolLM2
# tokenizer.json the model was trained with) puts each digit in its own piece first, so the run stays
# one piece. transformers' GGUF loader has no "smollm" entry and splits the run ("Ċ", "Ċ", "1").
DIGIT_AFTER_RUN_TEXTS = ["x\n\n1. item", "a  12", "  42", "total:\t\t7 apples"]

CONVERSATIONS: list[list[tuple[str, str]]] = [
    [("user", "What is 2+2?")],
    [("system", "You are terse."), ("user", "Name a color."), ("assistant", "Blue."), ("user", "Another?")],
    [("user", "héllo 世界 🤖"), ("assistant", "Hi!\n\n1. one\n2. two"), ("user", "<|im_end|> sneaky")],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_tokenizer(find_default_model())


@pytest.fixture(scope="module")
def reference() -> Any:
    return gguf_tokenizer(find_default_model())


@pytest.fixture(scope="module")
def trained_reference(reference: Any) -> Any:
    """transformers' GGUF tokenizer with the pre-tokenizer SmolLM2 was trained with (digits split first)."""
    backend = reference.backend_tokenizer.__class__.from_str(reference.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


def test_metadata(ours: Tokenizer) -> None:
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1
    assert ours.eos_token_ids == frozenset({2})
    assert ours.special_token_ids == frozenset(range(17))
    assert ours.add_bos is False
    assert ours.id_to_token(1) == "<|im_start|>"
    assert ours.id_to_token(49152) is None
    assert ours.token_to_id("<|im_end|>") == 2
    assert ours.convert_ids_to_tokens([19556, 905, 2]) == ["Hello", "Ġworld", "<|im_end|>"]
    with pytest.raises(ValueError, match="49152"):
        ours.convert_ids_to_tokens([49152])


@pytest.mark.parametrize("text", PARITY_TEXTS)
def test_ids_match_transformers(ours: Tokenizer, reference: Any, text: str) -> None:
    assert ours.encode(text) == reference.encode(text)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", PARITY_TEXTS + DIGIT_AFTER_RUN_TEXTS)
def test_ids_match_trained_pre_tokenizer(ours: Tokenizer, trained_reference: Any, text: str) -> None:
    assert ours.encode(text) == trained_reference.encode(text).ids


def test_whitespace_run_before_digit_stays_one_token(ours: Tokenizer, reference: Any) -> None:
    assert ours.convert_ids_to_tokens(ours.encode("x\n\n1")) == ["x", "ĊĊ", "1"]
    assert ours.convert_ids_to_tokens(ours.encode("a  12")) == ["a", "ĠĠ", "1", "2"]
    # The known divergence from transformers' GGUF loader, pinned so a change on either side shows.
    assert reference.convert_ids_to_tokens(reference.encode("x\n\n1")) == ["x", "Ċ", "Ċ", "1"]


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab Z9\n\t.,'éß中🤖<|>_")), max_size=40))
def test_random_text_matches_trained_pre_tokenizer(
    ours: Tokenizer, trained_reference: Any, text: str
) -> None:
    assert ours.encode(text) == trained_reference.encode(text).ids


def test_special_tokens_in_text_encode_as_single_ids(ours: Tokenizer) -> None:
    assert ours.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    ids = ours.encode("a<|endoftext|>b")
    assert ids[1] == 0 and ours.convert_ids_to_tokens(ids) == ["a", "<|endoftext|>", "b"]


@pytest.mark.parametrize("text", PARITY_TEXTS + DIGIT_AFTER_RUN_TEXTS)
def test_decode_round_trips(ours: Tokenizer, reference: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_decode_skips_special_tokens(ours: Tokenizer) -> None:
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ours.decode(ids) == "user\nhi"
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_decode_partial_character_gives_replacement(ours: Tokenizer) -> None:
    ids = ours.encode("🤖")
    assert len(ids) > 1
    assert ours.decode(ids[:1]).endswith("\ufffd")
    assert ours.decode(ids) == "🤖"


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(
    ours: Tokenizer, reference: Any, trained_reference: Any, conversation: list[tuple[str, str]]
) -> None:
    messages = [{"role": role, "content": content} for role, content in conversation]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    rendered = ours.apply_chat_template(conversation)
    assert rendered == expected
    # The third conversation has "\n\n1." in it, where transformers' GGUF split differs (see above).
    assert ours.encode(rendered) == trained_reference.encode(expected).ids
    if "\n\n1" not in rendered:
        assert ours.encode(rendered) == reference.encode(expected)
    no_prompt = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(conversation, add_generation_prompt=False) == no_prompt


def test_chat_template_exact_render(ours: Tokenizer) -> None:
    rendered = ours.apply_chat_template([("system", "Be brief."), ("user", "Hi")])
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = ours.encode(rendered)
    assert ids[0] == 1
    assert ids.count(1) == 3 and ids.count(2) == 2


# --- Hugging Face directory ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(reference: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    reference.save_pretrained(str(directory))
    return directory


def test_hf_directory_matches_gguf(hf_dir: Path, ours: Tokenizer, reference: Any) -> None:
    loaded = load_tokenizer(hf_dir)
    assert loaded.vocab_size == ours.vocab_size
    assert loaded.bos_token_id == 1
    assert loaded.eos_token_ids == frozenset({2})
    assert loaded.special_token_ids == ours.special_token_ids
    assert loaded.add_bos is False
    for text in PARITY_TEXTS:
        assert loaded.encode(text) == reference.encode(text)
        assert loaded.decode(loaded.encode(text), skip_special_tokens=False) == text
    for conversation in CONVERSATIONS:
        assert loaded.apply_chat_template(conversation) == ours.apply_chat_template(conversation)


def _copy_without_template(hf_dir: Path, tmp_path: Path, **config_updates: Any) -> Path:
    shutil.copy(hf_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config.update(config_updates)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_hf_directory_bos_eos_and_named_template(hf_dir: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
    directory = _copy_without_template(
        hf_dir,
        tmp_path,
        add_bos_token=True,
        bos_token={"content": "<|endoftext|>", "special": True},
        chat_template=[{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}],
    )
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (directory / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    loaded = load_tokenizer(directory)
    assert loaded.bos_token_id == 0
    assert loaded.add_bos is True
    assert loaded.eos_token_ids == frozenset({0, 2, 5})
    assert loaded.encode("Hello") == [0, 19556]
    assert loaded.encode("Hello", add_special_tokens=False) == [19556]
    assert loaded.encode("<|endoftext|>Hello") == [0, 19556]  # BOS written by a template is not doubled
    # The template's eos_token is the tokenizer's own EOS, not another id the model configs list.
    rendered = loaded.apply_chat_template([("user", "a"), ("assistant", "b")])
    assert rendered == "[user]a<|im_end|>[assistant]b<|im_end|>"


def test_chat_template_rejecting_a_role_raises_value_error(hf_dir: Path, tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('Only user and assistant roles are supported, not ' + m['role']) }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    loaded = load_tokenizer(_copy_without_template(hf_dir, tmp_path, chat_template=template))
    assert loaded.apply_chat_template([("user", "ok")]) == "ok"
    with pytest.raises(ValueError, match="not system"):
        loaded.apply_chat_template([("system", "x"), ("user", "ok")])


def test_missing_or_broken_chat_template_raises_value_error(hf_dir: Path, tmp_path: Path) -> None:
    loaded = load_tokenizer(_copy_without_template(hf_dir, tmp_path))
    assert loaded.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        loaded.apply_chat_template([("user", "hi")])
    broken = load_tokenizer(_copy_without_template(hf_dir, tmp_path, chat_template="{% for m in %}"))
    with pytest.raises(ValueError, match="does not compile"):
        broken.apply_chat_template([("user", "hi")])


def test_template_cannot_escape_the_sandbox(hf_dir: Path, tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    loaded = load_tokenizer(_copy_without_template(hf_dir, tmp_path, chat_template=template))
    with pytest.raises(ValueError, match="failed to render"):
        loaded.apply_chat_template([("user", "hi")])


def test_hf_directory_errors_name_the_file(hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
    directory = _copy_without_template(hf_dir, tmp_path, eos_token="<|no such token|>")
    with pytest.raises(TokenizerLoadError, match=r"tokenizer_config\.json: eos_token"):
        load_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match=r"tokenizer_config\.json: not valid JSON"):
        load_tokenizer(directory)
    with pytest.raises(TokenizerLoadError, match="no such file"):
        load_tokenizer(tmp_path / "absent.gguf")


# --- small synthetic GGUF files ---------------------------------------------------------------------

# A byte-level vocabulary whose merges show how the text was split: "Ġ1" forms only when a space and
# a digit share a piece, "12" only when two digits do.
TINY_TOKENS = ["<|end|>", "a", "b", "1", "2", "Ġ", "ab", "Ġ1", "12"]
TINY_MERGES = ["a b", "Ġ 1", "1 2"]


def _write_gguf(path: Path, **keys: Any) -> Path:
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model(keys.get("model", "gpt2"))
    if "pre" in keys:
        writer.add_tokenizer_pre(keys["pre"])
    writer.add_token_list(keys.get("tokens", TINY_TOKENS))
    writer.add_token_merges(keys.get("merges", TINY_MERGES))
    writer.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(TINY_TOKENS) - 1))
    writer.add_eos_token_id(keys.get("eos", 0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("pre", "expected"),
    [
        (None, ["ab", "Ġ1", "2"]),  # no `pre` key: GPT-2's split
        ("gpt2", ["ab", "Ġ1", "2"]),
        ("smollm", ["ab", "Ġ", "1", "2"]),
        ("llama-bpe", ["ab", "Ġ", "12"]),
        ("qwen2", ["ab", "Ġ", "1", "2"]),
    ],
)
def test_gguf_pre_tokenizer_follows_pre_key(tmp_path: Path, pre: str | None, expected: list[str]) -> None:
    keys = {} if pre is None else {"pre": pre}
    tokenizer = load_tokenizer(_write_gguf(tmp_path / "tiny.gguf", **keys))
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("ab 12")) == expected
    assert tokenizer.encode("ab<|end|>") == [6, 0]
    assert tokenizer.eos_token_ids == frozenset({0})
    assert tokenizer.bos_token_id is None and tokenizer.add_bos is False
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([("user", "hi")])


def test_gguf_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.ggml\.model 'llama' is not supported"):
        load_tokenizer(_write_gguf(tmp_path / "spm.gguf", model="llama"))
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.ggml\.pre 'mystery' is not supported"):
        load_tokenizer(_write_gguf(tmp_path / "pre.gguf", pre="mystery"))
    with pytest.raises(TokenizerLoadError, match=r"eos_token_id = 99 is outside"):
        load_tokenizer(_write_gguf(tmp_path / "eos.gguf", eos=99))
    with pytest.raises(TokenizerLoadError, match=r"merges\[0\]"):
        load_tokenizer(_write_gguf(tmp_path / "merges.gguf", merges=["ab"]))
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(TokenizerLoadError, match=r"junk\.gguf"):
        load_tokenizer(not_gguf)
