"""Text <-> token ids, and chat prompts, for the scheduler process.

Loads a model's tokenizer from a GGUF file (byte-level BPE vocabularies) or from a Hugging Face
directory (tokenizer.json). Runs on `tokenizers` + `jinja2` only: the scheduler never imports torch
or transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import gguf
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from scheduler.gguf_file import read_gguf

__all__ = ["Tokenizer", "TokenizerLoadError", "load_tokenizer"]


# Split patterns for the `tokenizer.ggml.pre` values whose regex differs from GPT-2's. They are the
# public pre-tokenizer definitions of those model families (as llama.cpp applies them).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` values, grouped by the pre-tokenizer they call for.
_PRE_GPT2 = ("gpt2", "mpt", "olmo", "jais", "trillion")
_PRE_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_PRE_LLAMA3 = ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")
_PRE_QWEN2 = ("qwen2", "stablelm2", "deepseek-r1-qwen")
_SUPPORTED_PRE = (*_PRE_GPT2, *_PRE_DIGITS_THEN_GPT2, *_PRE_LLAMA3, *_PRE_QWEN2)


class TokenizerLoadError(ValueError):
    """A model's tokenizer files are missing, malformed or describe an unsupported tokenizer."""


class _TemplateRaised(Exception):
    """Raised by `raise_exception(...)` inside a chat template."""


class Tokenizer:
    """One model's tokenizer: encode/decode, special tokens and the model's chat template.

    Special tokens written literally in text (e.g. "<|im_start|>") encode as their single ids.
    """

    __slots__ = (
        "_backend",
        "_bos_token",
        "_eos_token",
        "_template",
        "_template_error",
        "add_bos",
        "bos_token_id",
        "chat_template",
        "eos_token_ids",
        "special_token_ids",
        "vocab_size",
    )

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_eos_token_ids: frozenset[int] = frozenset(),
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        # BOS is added by `encode`, never by a post-processor, so `add_bos` is the only switch.
        backend.post_processor = None
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        eos_token_ids = extra_eos_token_ids | ({eos_token_id} if eos_token_id is not None else set())
        for name, token_id in (("bos", bos_token_id), *(("eos", i) for i in sorted(eos_token_ids))):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise TokenizerLoadError(
                    f"{name} token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )
        self.bos_token_id: int | None = bos_token_id
        # Generation ends on any of these; `eos_token_id` is the one chat templates write.
        self.eos_token_ids: frozenset[int] = eos_token_ids
        self.add_bos: bool = add_bos and bos_token_id is not None
        self.special_token_ids: frozenset[int] = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )
        self.chat_template: str | None = chat_template
        self._bos_token = None if bos_token_id is None else backend.id_to_token(bos_token_id)
        self._eos_token = None if eos_token_id is None else backend.id_to_token(eos_token_id)
        # Compiled once; a template that does not compile fails only chat requests, not the model.
        self._template: jinja2.Template | None = None
        self._template_error: str | None = None
        if chat_template is not None:
            try:
                self._template = _template_environment().from_string(chat_template)
            except jinja2.TemplateError as exc:
                self._template_error = f"the model's chat template does not compile: {exc}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS first when the model asks for it.

        BOS is not doubled when the text already starts with it (chat templates often write it).
        """
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            assert self.bos_token_id is not None
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form valid UTF-8 decode to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id, or None when the id is not in the vocabulary."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary string, or None."""
        return self._backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings of `ids`; raises ValueError on an id outside the vocabulary."""
        tokens = []
        for token_id in ids:
            token = self._backend.id_to_token(token_id)
            if token is None:
                raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
            tokens.append(token)
        return tokens

    def apply_chat_template(
        self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render (role, content) messages with the model's own chat template.

        Raises ValueError when the model has no template or the template rejects the conversation.
        """
        if self._template is None:
            raise ValueError(self._template_error or "the model has no chat template")
        for index, message in enumerate(messages):
            if len(message) != 2 or not all(isinstance(part, str) for part in message):
                raise ValueError(f"messages[{index}] must be a (role, content) pair of strings")
        context: dict[str, Any] = {
            "messages": [{"role": role, "content": content} for role, content in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        if self._bos_token is not None:
            context["bos_token"] = self._bos_token
        if self._eos_token is not None:
            context["eos_token"] = self._eos_token
        try:
            return self._template.render(**context)
        except _TemplateRaised as exc:
            raise ValueError(f"the chat template rejected the conversation: {exc}") from exc
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template failed to render: {exc}") from exc


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _template_environment() -> jinja2.Environment:
    """The environment chat templates are written against (trim/lstrip blocks, loop controls)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def load_tokenizer(model_path: str | Path) -> Tokenizer:
    """Load the tokenizer of a .gguf file or of a Hugging Face directory (tokenizer.json)."""
    path = Path(model_path)
    if path.is_dir():
        return _load_hf_directory(path)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path)
    if not path.exists():
        raise TokenizerLoadError(f"{path}: no such file or directory")
    raise TokenizerLoadError(f"{path}: expected a .gguf file or a directory with tokenizer.json")


# --- GGUF -----------------------------------------------------------------------------------------


def _load_gguf(path: Path) -> Tokenizer:
    try:
        fields = read_gguf(path).fields
    except (ValueError, OSError) as exc:
        raise TokenizerLoadError(f"{path}: not a readable GGUF file: {exc}") from exc

    def field(key: str, kind: type | tuple[type, ...], required: bool = False) -> Any:
        value = fields.get(key)
        if value is None:
            if required:
                raise TokenizerLoadError(f"{path}: missing key {key!r}")
            return None
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, kind) for item in items):
            raise TokenizerLoadError(f"{path}: key {key!r} has an unexpected type")
        return value

    model = field("tokenizer.ggml.model", str, required=True)
    if model != "gpt2":
        raise TokenizerLoadError(
            f"{path}: tokenizer.ggml.model {model!r} is not supported; supported: 'gpt2' (byte-level BPE)"
        )
    tokens: list[str] = field("tokenizer.ggml.tokens", str, required=True)
    merges: list[str] = field("tokenizer.ggml.merges", str, required=True)
    token_types: list[int] = field("tokenizer.ggml.token_type", int) or []
    pre: str = field("tokenizer.ggml.pre", str) or "gpt2"
    if token_types and len(token_types) != len(tokens):
        raise TokenizerLoadError(
            f"{path}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
        )

    backend = BackendTokenizer(models.BPE(vocab=_vocab(path, tokens), merges=_split_merges(path, merges)))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(path, pre)
    backend.decoder = decoders.ByteLevel()
    # Control tokens are special (skipped on decode); user-defined ones are matched whole but kept.
    added = [
        AddedToken(token, special=kind == gguf.TokenType.CONTROL, normalized=False)
        for token, kind in zip(tokens, token_types, strict=False)  # token_type may be absent
        if kind in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)
    ]
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise TokenizerLoadError(f"{path}: tokenizer.ggml.tokens has duplicate or unreachable entries")

    def token_id(key: str) -> int | None:
        value: int | None = field(key, int)
        if value is not None and not 0 <= value < len(tokens):
            raise TokenizerLoadError(f"{path}: {key} = {value} is outside the vocabulary [0, {len(tokens)})")
        return value

    # End-of-turn / end-of-message tokens also end generation (llama.cpp treats them alike).
    extra_eos_ids = {token_id(f"tokenizer.ggml.{name}_token_id") for name in ("eot", "eom")}
    add_bos = field("tokenizer.ggml.add_bos_token", bool)
    return Tokenizer(
        backend,
        bos_token_id=token_id("tokenizer.ggml.bos_token_id"),
        eos_token_id=token_id("tokenizer.ggml.eos_token_id"),
        extra_eos_token_ids=frozenset(i for i in extra_eos_ids if i is not None),
        add_bos=bool(add_bos),  # byte-level BPE vocabularies add no BOS unless the file says so
        chat_template=field("tokenizer.chat_template", str),
    )


def _vocab(path: Path, tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if vocab.setdefault(token, index) != index:
            raise TokenizerLoadError(f"{path}: tokenizer.ggml.tokens[{index}] {token!r} is a duplicate")
    return vocab


def _split_merges(path: Path, merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for index, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise TokenizerLoadError(f"{path}: tokenizer.ggml.merges[{index}] {merge!r} is not 'left right'")
        pairs.append((parts[0], parts[1]))
    return pairs


def _byte_level_pre_tokenizer(path: Path, pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer `tokenizer.ggml.pre` names, in front of the byte-to-unicode mapping."""
    if pre in _PRE_GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_DIGITS_THEN_GPT2:
        # Every digit is its own piece before the GPT-2 split ("x\n\n1" -> "x", "\n\n", "1"),
        # as in the tokenizer these models were trained with.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _PRE_LLAMA3:
        return _split_then_bytes(_LLAMA3_SPLIT)
    if pre in _PRE_QWEN2:
        return _split_then_bytes(_QWEN2_SPLIT)
    raise TokenizerLoadError(
        f"{path}: tokenizer.ggml.pre {pre!r} is not supported; supported: {', '.join(_SUPPORTED_PRE)}"
    )


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# --- Hugging Face directory -----------------------------------------------------------------------


def _load_hf_directory(directory: Path) -> Tokenizer:
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise TokenizerLoadError(f"{tokenizer_file}: missing (a model directory needs tokenizer.json)")
    try:
        backend = BackendTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side raises plain Exception on malformed JSON
        raise TokenizerLoadError(f"{tokenizer_file}: not a valid tokenizers file: {exc}") from exc
    config_file = directory / "tokenizer_config.json"
    tok_config = _read_json(config_file)
    model_config = _read_json(directory / "config.json")
    generation_config = _read_json(directory / "generation_config.json")

    def named_token_id(key: str) -> int | None:
        value = tok_config.get(key)
        if isinstance(value, dict):  # serialised AddedToken
            value = value.get("content")
        if value is None:
            return None
        if not isinstance(value, str):
            raise TokenizerLoadError(f"{config_file}: {key} must be a string or a token object")
        found = backend.token_to_id(value)
        if found is None:
            raise TokenizerLoadError(f"{config_file}: {key} {value!r} is not in {tokenizer_file.name}")
        return found

    bos_id = named_token_id("bos_token")
    if bos_id is None:
        bos_id = next(iter(_config_ids(directory / "config.json", model_config, "bos_token_id")), None)
    # The tokenizer's own EOS is the one templates write; the model configs may list more.
    extra_eos_ids = _config_ids(directory / "generation_config.json", generation_config, "eos_token_id")
    extra_eos_ids += _config_ids(directory / "config.json", model_config, "eos_token_id")
    eos_id = named_token_id("eos_token")
    if eos_id is None:
        eos_id = next(iter(extra_eos_ids), None)

    add_bos = tok_config.get("add_bos_token")
    if add_bos is None:
        # No explicit flag: trust what tokenizer.json's post-processor does to an empty input.
        add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
    elif not isinstance(add_bos, bool):
        raise TokenizerLoadError(f"{config_file}: add_bos_token must be true or false")

    return Tokenizer(
        backend,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        extra_eos_token_ids=frozenset(extra_eos_ids),
        add_bos=add_bos,
        chat_template=_hf_chat_template(directory, config_file, tok_config),
    )


def _read_json(path: Path) -> dict[str, Any]:
    """The object in an optional JSON file; {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise TokenizerLoadError(f"{path}: expected a JSON object at the top level")
    return value


def _config_ids(path: Path, config: dict[str, Any], key: str) -> list[int]:
    value = config.get(key)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizerLoadError(f"{path}: {key} must be an integer or a list of integers")
    return values


def _hf_chat_template(directory: Path, config_file: Path, tok_config: dict[str, Any]) -> str | None:
    """chat_template.jinja when present, else tokenizer_config.json's chat_template ("default" if named)."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    raise TokenizerLoadError(
        f"{config_file}: chat_template must be a string or a list with a template named 'default'"
    )
