"""llama.cpp's ``convert_hf_to_gguf.py`` on a benchmark checkpoint, run in the torch env.

    TORCH_PYTHON -P benchmarks/gguf_convert.py LLAMA_CPP_DIR CHECKPOINT --outtype f32 \
        --outfile OUT.gguf

The converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a test
string, and stops on one it does not know: the benchmark tokenizer is trained by the
fixture script (Llama 3's special tokens and byte-level BPE), so it is named ``llama-bpe``
here. Only the detokenizer matters to the benchmark: every prompt is sent as token ids.

This file imports neither shardserve nor the benchmarks package.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    llama_cpp, checkpoint, *rest = sys.argv[1:]
    sys.path.insert(0, llama_cpp)
    from conversion import base  # the converter's own package, beside it

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "llama-bpe"
    converter = Path(llama_cpp) / "convert_hf_to_gguf.py"
    sys.argv = [str(converter), checkpoint, *rest]
    runpy.run_path(str(converter), run_name="__main__")


if __name__ == "__main__":
    main()
