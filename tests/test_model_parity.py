"""Greedy parity with transformers: our paged, chunked, batched forward must pick the same tokens."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.attention import CpuPagedAttention
from gpu_worker.batch import ScheduledChunk, build_forward_batch
from gpu_worker.kv_cache import allocate_kv_cache
from gpu_worker.linear import BLOCK_MAX_ROWS, block_kernel, cpu_multiplies_bfloat16
from gpu_worker.loader import load_block_weights, load_model
from gpu_worker.model import LlamaModel, blocks_only_weights
from gpu_worker.model_config import ModelConfig
from gpu_worker.startup import make_attention
from kernels.cpu_block_linear import BlockLinear
from scheduler.model_files import find_default_model
from tests.cpu_features import cpu_has
from tests.transformers_reference import gguf_model, gguf_tokenizer, reference_greedy

transformers = pytest.importorskip("transformers")


@dataclass(slots=True)
class _Sequence:
    tokens: list[int]
    prompt_len: int
    share: tuple[int, int] | None = None  # (source sequence, full blocks borrowed from its prompt)
    computed: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    started: bool = False
    done: bool = False


class PagedHarness:
    """A miniature scheduler: block allocator with ref counts, token budget, random chunking and order."""

    def __init__(self, model: LlamaModel, config: ModelConfig, block_size: int, num_blocks: int) -> None:
        self.model, self.block_size = model, block_size
        self.kv_caches = allocate_kv_cache(config, num_blocks, block_size, model.dtype, model.device)
        self.free = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks

    def _allocate(self, seq: _Sequence, upto: int) -> None:
        while len(seq.blocks) * self.block_size < upto:
            block = self.free.pop()
            self.refs[block] += 1
            seq.blocks.append(block)

    def _release(self, seq: _Sequence) -> None:
        for block in seq.blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)
        seq.blocks = []

    def _start(self, seqs: list[_Sequence], seq: _Sequence) -> bool:
        if seq.share is not None:
            source, num_blocks = seqs[seq.share[0]], seq.share[1]
            if source.computed < num_blocks * self.block_size:
                return False  # the prefix is not cached yet
            seq.blocks = source.blocks[:num_blocks]
            for block in seq.blocks:
                self.refs[block] += 1
            seq.computed = num_blocks * self.block_size
        seq.started = True
        return True

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        seed: int,
        token_budget: int = 48,
        shares: dict[int, tuple[int, int]] | None = None,
        max_chunk: int = 13,
    ) -> list[list[int]]:
        rng = random.Random(seed)
        seqs = [_Sequence(list(p), len(p), (shares or {}).get(i)) for i, p in enumerate(prompts)]
        while not all(s.done for s in seqs):
            chunks, owners, budget = [], [], token_budget
            # Running decodes first (as the real planner does), then prefill chunks, shuffled.
            active = [s for s in seqs if not s.done and (s.started or self._start(seqs, s))]
            active.sort(key=lambda s: len(s.tokens) - s.computed != 1)
            for seq in active:
                take = min(len(seq.tokens) - seq.computed, rng.randint(1, max_chunk), budget)
                if take <= 0:
                    continue
                budget -= take
                self._allocate(seq, seq.computed + take)
                chunks.append(
                    ScheduledChunk(
                        token_ids=seq.tokens[seq.computed : seq.computed + take],
                        start_position=seq.computed,
                        block_table=list(seq.blocks),
                        needs_logits=seq.computed + take == len(seq.tokens),
                    )
                )
                owners.append(seq)
            order = list(range(len(chunks)))
            rng.shuffle(order)
            chunks, owners = [chunks[i] for i in order], [owners[i] for i in order]
            batch = build_forward_batch(chunks, self.block_size, self.model.device)
            logits = self.model(batch, self.kv_caches)  # [S, vocab]
            picks = iter(logits.argmax(dim=-1).tolist())
            for chunk, seq in zip(chunks, owners, strict=True):
                seq.computed += len(chunk.token_ids)
                if chunk.needs_logits:
                    seq.tokens.append(next(picks))
                    if len(seq.tokens) - seq.prompt_len == max_new_tokens:
                        seq.done = True
                        self._release(seq)
        assert sorted(self.free) == list(range(len(self.refs))), "harness leaked blocks"
        return [s.tokens[s.prompt_len :] for s in seqs]


def test_forward_batch_layout_exact() -> None:
    chunks = [
        ScheduledChunk([10, 11, 12], start_position=5, block_table=[7, 2], needs_logits=True),  # prefill
        ScheduledChunk([20], start_position=3, block_table=[4], needs_logits=True),  # decode
        ScheduledChunk([30, 31], start_position=0, block_table=[9], needs_logits=False),  # mid-prompt
        ScheduledChunk([40], start_position=4, block_table=[1, 6], needs_logits=True),  # decode
    ]
    batch = build_forward_batch(chunks, block_size=4, device="cpu")
    assert batch.chunk_order == (1, 3, 0, 2)  # decodes first, then prefills, each in caller order
    assert batch.input_ids.tolist() == [20, 40, 10, 11, 12, 30, 31]
    assert batch.positions.tolist() == [3, 4, 5, 6, 7, 0, 1]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert batch.slot_mapping.tolist() == [
        4 * 4 + 3,
        6 * 4 + 0,
        2 * 4 + 1,
        2 * 4 + 2,
        2 * 4 + 3,
        9 * 4,
        9 * 4 + 1,
    ]
    assert batch.logits_indices.tolist() == [4, 0, 1]  # caller order: chunk 0, 1, 3
    assert batch.query_start_loc.tolist() == [0, 1, 2, 5, 7]
    assert batch.context_lens.tolist() == [4, 5, 8, 2]
    assert batch.block_tables.tolist() == [[4, 0], [1, 6], [7, 2], [9, 0]]
    decode = batch.decode
    # Padded up to whole blocks of 4: two blocks per row; padding reads block 0 and is masked.
    assert decode is not None and decode.num_seqs == 2 and decode.max_context == 8
    assert decode.key_blocks.view(2, 2).tolist() == [[4, 0], [1, 6]]
    assert decode.key_mask.view(2, 8).tolist() == [[True] * 4 + [False] * 4, [True] * 5 + [False] * 3]
    first, second = batch.prefills
    assert (first.token_start, first.num_tokens, first.start_position) == (2, 3, 5)
    assert first.key_slots is not None and first.mask is not None
    assert first.key_slots.tolist() == [28, 29, 30, 31, 8, 9, 10, 11]
    assert first.mask.tolist() == [[j <= 5 + i for j in range(8)] for i in range(3)]
    assert (second.token_start, second.num_tokens, second.key_slots, second.mask) == (5, 2, None, None)


TINY_VARIANTS: dict[int, dict[str, Any]] = {
    8: {},
    16: {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    },
    32: {"attention_bias": True, "tie_word_embeddings": True},
}


def tiny_hf_config(**variant: Any) -> Any:
    """A 2-layer Llama config with GQA (4 query heads, 2 KV heads), plus `variant`'s settings."""
    return transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.15,  # wide logits: no near-ties for float rounding to flip
        **variant,
    )


def use_backend(model: LlamaModel, config: ModelConfig, backend: str, block_size: int) -> None:
    if backend == "triton":
        pytest.importorskip("triton")  # on the CPU it runs interpreted (tests/conftest.py)
    model.use_attention(make_attention(backend, config, model.dtype, model.device, block_size))
    assert model.attention_backend == backend


# Every variant on every backend, except that Triton interpreted on the CPU (about 45 s a variant
# on 2 cores) takes the default block size only: tests/kernels checks its kernels at 8, 16 and 32
# against their references, and the variants' model features (Llama 3 rope scaling, qkv bias, tied
# embeddings) are checked on the other backends. On CUDA (make gpu-check) Triton takes all three.
TINY_CASES = [
    (block_size, backend)
    for block_size in sorted(TINY_VARIANTS)
    for backend in ("torch", "cpu", "triton")
    if backend != "triton" or torch.cuda.is_available() or block_size == 16
]


@pytest.mark.parametrize(("block_size", "backend"), TINY_CASES, ids=[f"{b}-{k}" for b, k in TINY_CASES])
def test_tiny_llama_matches_transformers(tmp_path: Path, block_size: int, backend: str) -> None:
    torch.manual_seed(block_size)
    hf_config = tiny_hf_config(**TINY_VARIANTS[block_size])
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    hf_model.save_pretrained(tmp_path)
    config, weights = load_model(tmp_path)
    assert config.attention_bias == hf_config.attention_bias
    assert (config.rope_scaling is not None) == ("rope_scaling" in TINY_VARIANTS[block_size])
    # Triton runs on the GPU where there is one (make gpu-check), else interpreted on the CPU.
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on both sides
    model = LlamaModel(config, torch.float32, device)
    model.load_weights(weights)
    use_backend(model, config, backend, block_size)

    gen = torch.Generator().manual_seed(block_size)
    lengths = [1, 3, 9, 17, 30, 41, 58, 64, 23]
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]
    # The last prompt starts with the first two blocks of prompt 5, so it begins after a cached prefix.
    shared = 2 * block_size if block_size < 32 else block_size
    prompts[-1] = prompts[5][: min(shared, 41)] + prompts[-1]
    shares = {len(prompts) - 1: (5, min(shared, 41) // block_size)}
    max_new = 12

    harness = PagedHarness(model, config, block_size, num_blocks=256 // block_size * 12)
    ours = harness.generate(prompts, max_new, seed=block_size, shares=shares)
    with torch.inference_mode():
        expected = [reference_greedy(hf_model, p, max_new) for p in prompts]
    assert ours == expected, (ours, expected)


@pytest.mark.skipif(
    cpu_multiplies_bfloat16() or not all(cpu_has(flag) for flag in ("avx2", "fma", "f16c")),
    reason="bfloat16 linears take the block kernel only on AVX2 CPUs that cannot multiply bfloat16",
)
def test_tiny_bfloat16_directory_on_the_block_kernel_matches_transformers(tmp_path: Path) -> None:
    """A Hugging Face directory in bfloat16 served in bfloat16 on a CPU without bfloat16 multiplies:
    every linear multiplies on its own bfloat16 weight on the block kernel, no copy made. The
    additions run in another order than transformers', and bfloat16's rounding of every layer's
    output lets greedy decoding drift after a while (at token 9 of the first prompt here), so the
    first 6 tokens are compared."""
    torch.manual_seed(3)
    hf_model = transformers.LlamaForCausalLM(tiny_hf_config(tie_word_embeddings=False))
    hf_model = hf_model.to(torch.bfloat16).eval()
    hf_model.save_pretrained(tmp_path)
    config, weights = load_model(tmp_path)
    model = LlamaModel(config, torch.bfloat16, "cpu")
    model.load_weights(weights, load_block_weights(tmp_path, config))
    assert model.block_linears == 4 * config.num_layers + 1
    for linear in model.linears():
        assert linear.blocks is not None and linear.blocks.blocks.data_ptr() == linear.weight.data_ptr()
    use_backend(model, config, "cpu", block_size=16)

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 9, 30, 41)]
    harness = PagedHarness(model, config, 16, num_blocks=64)
    ours = harness.generate(prompts, 6, seed=3)
    with torch.inference_mode():
        expected = [reference_greedy(hf_model, p, 6) for p in prompts]
    assert ours == expected


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the shipped GGUF


@pytest.fixture(scope="module")
def smollm2() -> tuple[Path, ModelConfig, LlamaModel]:
    path = find_default_model()
    config, weights = load_model(path)
    model = LlamaModel(config, torch.float32, "cpu")
    # The CPU worker's default path: decode steps multiply the file's Q4_1/Q8_0 blocks.
    model.load_weights(weights, load_block_weights(path, config))
    use_backend(model, config, "cpu", block_size=16)
    return path, config, model


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(
    smollm2: tuple[Path, ModelConfig, LlamaModel], smollm2_on_cpu_in_transformers: tuple[Any, Any]
) -> None:
    _, config, model = smollm2
    if block_kernel() is not None:
        assert model.block_linears == 4 * config.num_layers + 1
    check_smollm2_against_transformers(smollm2_on_cpu_in_transformers, config, model)


# About 1100 tokens of chat: its decode steps attend over more than 512 tokens, which the CPU decode
# kernel splits into parts of 128 tokens on all threads and folds (kernels/cpu/paged_decode_attention.c).
LONG_TEXT = " ".join(
    f"Day {day}: the ship sailed {day * 7} miles north, the crew counted {day + 3} gulls and "
    f"the cook served {['soup', 'bread', 'fish', 'rice'][day % 4]}."
    for day in range(1, 41)
)


@pytest.mark.slow
def test_smollm2_long_context_decode_matches_transformers(
    smollm2: tuple[Path, ModelConfig, LlamaModel], smollm2_on_cpu_in_transformers: tuple[Any, Any]
) -> None:
    _, config, model = smollm2
    texts = [LONG_TEXT + " On which day did the cook first serve rice?", CHAT_PROMPTS[0]]
    check_smollm2_against_transformers(
        smollm2_on_cpu_in_transformers, config, model, texts, 16, num_blocks=96
    )


@pytest.mark.slow
def test_smollm2_on_blocks_alone_matches_transformers(
    smollm2: tuple[Path, ModelConfig, LlamaModel],
    smollm2_on_cpu_in_transformers: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """float32 with --dense-weights drop: the layers' weights never read as float32, every step on
    the file's blocks, prefill chunks of up to 512 tokens included (past BLOCK_MAX_ROWS)."""
    path, config, _ = smollm2
    if block_kernel() is None:
        pytest.skip("the block kernel does not build here (it needs AVX2, FMA and F16C)")
    blocks = load_block_weights(path, config)
    _, weights = load_model(path, shape_only=blocks_only_weights(config, blocks))
    model = LlamaModel(config, torch.float32, "cpu")
    model.load_weights(weights, blocks)
    assert sum(lin.blocks_only for lin in model.linears()) == 4 * config.num_layers
    use_backend(model, config, "cpu", block_size=16)
    rows: list[int] = []
    multiply = BlockLinear.__call__
    monkeypatch.setattr(BlockLinear, "__call__", lambda *a: rows.append(a[1].shape[0]) or multiply(*a))
    texts = [LONG_TEXT + " On which day did the cook first serve rice?", CHAT_PROMPTS[1]]
    check_smollm2_against_transformers(
        smollm2_on_cpu_in_transformers,
        config,
        model,
        texts,
        16,
        num_blocks=96,
        token_budget=512,
        max_chunk=512,
    )
    assert max(rows) > BLOCK_MAX_ROWS


@pytest.mark.slow
def test_smollm2_in_k_quant_blocks_matches_transformers(
    requantized_smollm2: Callable[[str], tuple[Path, str]],
) -> None:
    """SmolLM2 requantized to Q3_K by bench/requantize_gguf.py: Q3_K super-blocks in ffn_down, and
    IQ4_NL, what llama.cpp writes for Q2_K, Q3_K and IQ4_XS rows that are not 256 long (SmolLM2's
    576), in every other layer matrix, so most of a small model's Q2_K or Q3_K_M file. Every layer
    linear multiplies the file's blocks, the decode stack included, and greedy output equals
    transformers float32 on the same file. (The Q4_K_M mix's Q4_K, Q6_K, Q5_0 and mixed q/k/v are
    held to transformers' greedy output through a server: tests/e2e/test_k_quant_file.py.)"""
    path, written = requantized_smollm2("Q3_K")
    assert "180 IQ4_NL, 30 Q3_K" in written
    config, weights = load_model(path)
    blocks = load_block_weights(path, config)
    layer_types = {b.type_name for name, b in blocks.items() if name.startswith("model.layers.")}
    assert layer_types == {"Q3_K", "IQ4_NL"}
    model = LlamaModel(config, torch.float32, "cpu")
    model.load_weights(weights, blocks)
    if block_kernel() is not None:
        assert model.block_linears == 4 * config.num_layers + 1
    use_backend(model, config, "cpu", block_size=16)
    attention = model.attention
    assert isinstance(attention, CpuPagedAttention)
    if block_kernel() is not None:  # decode steps run every layer in one call on those blocks
        assert attention.decode_stack is not None and attention.decode_stack.blocks
    check_smollm2_against_transformers(smollm2_reference(path, "cpu"), config, model, CHAT_PROMPTS[:2], 16)


@pytest.mark.slow
@pytest.mark.skipif(
    cpu_multiplies_bfloat16() or not all(cpu_has(flag) for flag in ("avx2", "fma", "f16c")),
    reason="bfloat16 takes the GGUF blocks only on AVX2 CPUs that cannot multiply bfloat16",
)
def test_smollm2_bfloat16_on_gguf_blocks_follows_transformers_bfloat16(
    smollm2: tuple[Path, ModelConfig, LlamaModel],
) -> None:
    """bfloat16 on a CPU without bfloat16 multiplies: every linear on the file's blocks, each weight
    rounded to bfloat16 as transformers' bfloat16 copy holds it. bfloat16's rounding lets greedy
    decoding drift from transformers' after a while (it did at token 19 of the first prompt here,
    where float32's top two logits were 0.08 apart), so the first 16 tokens are compared."""
    path, config, _ = smollm2
    _, weights = load_model(path)
    model = LlamaModel(config, torch.bfloat16, "cpu")
    model.load_weights(weights, load_block_weights(path, config))
    assert model.block_linears == 4 * config.num_layers + 1
    use_backend(model, config, "cpu", block_size=16)
    attention = model.attention
    assert isinstance(attention, CpuPagedAttention) and attention.decode_stack is not None
    assert attention.decode_stack.blocks and attention.decode_stack.dtype == torch.bfloat16
    reference = gguf_tokenizer(path), gguf_model(path, torch.bfloat16)
    check_smollm2_against_transformers(reference, config, model, max_new=16)


@pytest.mark.gpu
def test_smollm2_on_cuda_with_triton_kernels_matches_transformers() -> None:
    """The GPU path (Triton attention, fused norms, rotary and SiLU) against transformers on the same GPU."""
    assert torch.cuda.is_available(), "the gpu subset runs on a machine with a CUDA device (make gpu-check)"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on both sides
    path = find_default_model()
    config, weights = load_model(path)
    model = LlamaModel(config, torch.float32, "cuda")
    model.load_weights(weights)
    use_backend(model, config, "triton", block_size=16)
    check_smollm2_against_transformers(smollm2_reference(path, "cuda"), config, model)


def smollm2_reference(path: Path, device: str) -> tuple[Any, Any]:
    """transformers' tokenizer and float32 model for the same GGUF file."""
    return gguf_tokenizer(path), gguf_model(path).to(device)


@pytest.fixture(scope="module")
def smollm2_on_cpu_in_transformers(smollm2: tuple[Path, ModelConfig, LlamaModel]) -> tuple[Any, Any]:
    return smollm2_reference(smollm2[0], "cpu")


def check_smollm2_against_transformers(
    reference: tuple[Any, Any],
    config: ModelConfig,
    model: LlamaModel,
    texts: list[str] = CHAT_PROMPTS,
    max_new: int = 32,
    num_blocks: int = 64,
    token_budget: int = 64,
    max_chunk: int = 13,
) -> None:
    tokenizer, hf_model = reference
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for text in texts
    ]
    with torch.inference_mode():
        expected = [reference_greedy(hf_model, p, max_new) for p in prompts]
    harness = PagedHarness(model, config, block_size=16, num_blocks=num_blocks)
    ours = harness.generate(prompts, max_new, seed=0, token_budget=token_budget, max_chunk=max_chunk)
    assert ours == expected, [tokenizer.decode(t) for t in ours + expected]
