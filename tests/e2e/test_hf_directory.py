"""A Hugging Face model directory served end to end: safetensors weights, tokenizer.json, chat template.

A tiny random Llama (built from a config here) with SmolLM2's tokenizer; greedy outputs of
concurrent requests through the real server equal transformers `generate` on the same weights.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from duoserve_client import Client
from gpu_worker.linear import BLOCK_MAX_ROWS, block_kernel
from scheduler.model_files import find_default_model
from tests.e2e.harness import ServerProcess, serve_greedy, start_server
from tests.transformers_reference import gguf_tokenizer

pytestmark = pytest.mark.slow

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    gguf = find_default_model()
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = gguf_tokenizer(gguf)
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def tiny_bfloat16_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model as a bfloat16 checkpoint (the dtype most Hugging Face checkpoints ship in)."""
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama-bf16")
    for file in tiny_model_dir.iterdir():
        if not file.name.endswith(".safetensors"):
            shutil.copy(file, folder / file.name)
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    server = start_server("--model", str(tiny_model_dir), "--dtype", "float32", "--metrics-port", "0")
    yield server
    assert server.stop() == 0
    assert server.leftovers() == []


def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(
                ids, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=2
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def test_hf_directory_greedy_matches_transformers_under_concurrency(
    tiny_server: ServerProcess, tiny_model_dir: Path
) -> None:
    with Client(tiny_server.target) as client:
        (model,) = client.list_models()
        assert model.name == tiny_model_dir.name and model.vocab_size == 49152
        prompts = [client.tokenize(f"Prompt number {i}: " + "words " * (i * 7)) for i in range(8)]
        with ThreadPoolExecutor(max_workers=8) as pool:
            served = list(
                pool.map(
                    lambda p: (
                        client.generate(prompt_token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True).token_ids
                    ),
                    prompts,
                )
            )
        chat = client.chat([("user", "Hello!")], max_tokens=4, ignore_eos=True)
    assert len({len(p) for p in prompts}) == 8
    assert served == reference(tiny_model_dir, prompts)
    assert len(chat.token_ids) == 4  # the directory's chat template rendered and served


def test_a_stream_interval_groups_streamed_tokens_and_keeps_the_output(tiny_model_dir: Path) -> None:
    """--stream-interval 5: the first token alone, then five to a chunk; the tokens and text are
    those of a unary call, and greedy still matches transformers."""
    server = start_server(
        "--model", str(tiny_model_dir), "--dtype", "float32", "--metrics-port", "0", "--stream-interval", "5"
    )  # fmt: skip
    try:
        with Client(server.target) as client:
            prompt = client.tokenize("Grouped tokens, please: " + "words " * 9)
            chunks = list(client.stream(prompt_token_ids=prompt, max_tokens=NEW_TOKENS, ignore_eos=True))
            whole = client.generate(prompt_token_ids=prompt, max_tokens=NEW_TOKENS, ignore_eos=True)
    finally:
        assert server.stop() == 0
    assert [len(chunk.token_ids) for chunk in chunks] == [1, 5, 5, 1]  # NEW_TOKENS = 12
    assert [t for chunk in chunks for t in chunk.token_ids] == whole.token_ids
    assert "".join(chunk.text for chunk in chunks) == whole.text
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage is not None
    assert whole.token_ids == reference(tiny_model_dir, [prompt])[0]


def greedy_gaps(model_dir: Path, prompt: list[int], served: list[int]) -> list[float]:
    """For each served token, how far its logit in transformers float32 (fed the served prefix)
    lies below that position's largest: 0 where the token is transformers' own greedy choice."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + served])).logits[0, len(prompt) - 1 : -1]
    return [float(row.max() - row[token]) for row, token in zip(logits, served, strict=True)]


def test_an_int8_kv_cache_serves_the_greedy_tokens_within_its_rounding(tiny_model_dir: Path) -> None:
    """--kv-cache-dtype int8, with prompts in chunks of 64 tokens (so later chunks read their prefix
    from the int8 cache) and one prompt twice (the second finds it in the prefix cache): ListModels
    says int8; every served token is transformers' greedy choice on the same prefix or within 0.05
    of its logit (the cache's rounding, about 1/254 of each row's largest value, moves the logits by
    a few thousandths here); streaming and a repeat give the same tokens."""
    server = start_server(
        "--model", str(tiny_model_dir), "--dtype", "float32", "--metrics-port", "0",
        "--kv-cache-dtype", "int8", "--prefill-chunk", "64",
    )  # fmt: skip
    try:
        with Client(server.target) as client:
            (model,) = client.list_models()
            prompts = [
                client.tokenize(f"Int8 prompt {i}: " + "words and more words " * (i * 20)) for i in range(3)
            ]
            served = [
                client.generate(prompt_token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True).token_ids
                for p in prompts
            ]
            again = client.generate(prompt_token_ids=prompts[2], max_tokens=NEW_TOKENS, ignore_eos=True)
            streamed = list(
                client.stream(prompt_token_ids=prompts[1], max_tokens=NEW_TOKENS, ignore_eos=True)
            )
    finally:
        assert server.stop() == 0
    assert model.kv_cache_dtype == "int8" and model.dtype == "float32"
    assert "KV blocks of 16 tokens (int8)" in server.log()
    assert max(len(p) for p in prompts) > 128  # three chunks or more
    assert again.usage is not None and again.usage.cached_prompt_tokens >= 128
    assert again.token_ids == served[2]
    assert [t for chunk in streamed for t in chunk.token_ids] == served[1]
    gaps = [
        gap
        for prompt, tokens in zip(prompts, served, strict=True)
        for gap in greedy_gaps(tiny_model_dir, prompt, tokens)
    ]
    assert len(gaps) == 3 * NEW_TOKENS and max(gaps) < 0.05, gaps


def test_bfloat16_directory_served_in_float32_streams_its_own_tensors(tiny_bfloat16_dir: Path) -> None:
    """float32 serving of a bfloat16 checkpoint on the CPU: decode steps multiply the file's
    bfloat16 tensors on the block kernel (half the bytes of float32 copies); greedy output equals
    transformers' float32 on the same (exactly widened) weights."""
    server = start_server("--model", str(tiny_bfloat16_dir), "--dtype", "float32", "--metrics-port", "0")
    texts = [f"Question {i}: " + "why " * (i * 5) for i in range(4)]
    prompts, served = serve_greedy(server, texts, NEW_TOKENS)
    if block_kernel() is not None:
        assert (
            f"9 of 9 linears take the block kernel for steps of up to {BLOCK_MAX_ROWS} rows (9 BF16)"
            in server.log()
        )
    assert served == reference(tiny_bfloat16_dir, prompts)


def test_bfloat16_directory_on_its_tensors_alone(tiny_bfloat16_dir: Path) -> None:
    """--dense-weights drop: a float32 server never reads the linears' float32 copies; every step,
    a 300-token prefill included, multiplies the file's bfloat16 tensors. Greedy output still
    equals transformers' float32 on the same weights."""
    server = start_server(
        "--model",
        str(tiny_bfloat16_dir),
        "--dtype",
        "float32",
        "--dense-weights",
        "drop",
        "--metrics-port",
        "0",
    )
    prompts, served = serve_greedy(server, ["Long question: " + "and why " * 150, "Short one?"], NEW_TOKENS)
    assert len(prompts[0]) > 256
    if block_kernel() is not None:
        assert "9 of 9 linears take the block kernel" in server.log()
        assert "9 of them hold no dense copy and take it at every step (--dense-weights drop)" in server.log()
    assert served == reference(tiny_bfloat16_dir, prompts)


@pytest.mark.parametrize("fault", ["a tensor missing", "float16 on the CPU"])
def test_a_worker_that_cannot_start_stops_the_server_without_restarts(
    tiny_model_dir: Path, tmp_path: Path, fault: str
) -> None:
    """A model the worker cannot load, or a setting it cannot run with, fails the same way on
    every start: the server stops at once with the reason, instead of restarting the worker."""
    import shutil

    import safetensors.torch

    model, flags, reason = tiny_model_dir, ["--dtype", "float32"], "--dtype float16 is supported on CUDA only"
    if fault == "a tensor missing":
        model = tmp_path / "broken"
        shutil.copytree(tiny_model_dir, model)
        (weights,) = model.glob("*.safetensors")
        tensors = safetensors.torch.load_file(weights)
        del tensors["model.layers.1.mlp.down_proj.weight"]
        safetensors.torch.save_file(tensors, weights, metadata={"format": "pt"})
        reason = "tensor 'model.layers.1.mlp.down_proj.weight' is missing"
    else:
        flags = ["--dtype", "float16", "--device", "cpu"]
    server = start_server("--model", str(model), *flags, wait=False)
    try:
        code = server.process.wait(timeout=120)
    finally:
        server.stop(signal.SIGKILL)
    log = server.log()
    assert code == 1, log[-4000:]
    assert reason in log and "cannot start with this model and these settings" in log, log[-4000:]
    assert "restarting it" not in log and "Traceback" not in log, log[-4000:]
