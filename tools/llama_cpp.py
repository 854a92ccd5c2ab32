"""llama.cpp's GGUF converter and llama-quantize, as the tests and benches run them.

One shim for tests/llm/test_gguf.py, bench/gguf.py and bench/llm_serving.py: llama.cpp's
`convert_hf_to_gguf.py`, run unchanged but told about the tokenizers it has never seen
here: tinylm's and the tests' byte-level BPEs split as GPT-2 does (instead of refusing
their hash), no SentencePiece attempt without a tokenizer.model (it then reads
tokenizer.json; the random bench models have one and take that path untouched), and
Gemma 2 without a tokenizer.model reads its vocab as Gemma 3 does. Several outputs go
through one process (one import of torch).

`CONVERTER`: the fetched converter (tools/fetch_gguf_converter.py; BITSERVE_LLAMA_CPP
moves it), `QUANTIZE` the llama-quantize built beside it (tools/build_llama_quantize.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CONVERTER = (
    Path(os.environ.get("BITSERVE_LLAMA_CPP", Path.home() / ".cache/bitserve/llama.cpp"))
    / "convert_hf_to_gguf.py"
)
QUANTIZE = CONVERTER.parent / "build" / "bin" / "llama-quantize"

RUN_CONVERTER = """
import json, runpy, sys
from pathlib import Path
conv = Path(sys.argv[1])
sys.path.insert(0, str(conv.parent))
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sentencepiece = base.TextModel._set_vocab_sentencepiece
def set_vocab_sentencepiece(self, *args, **kwargs):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return sentencepiece(self, *args, **kwargs)
base.TextModel._set_vocab_sentencepiece = set_vocab_sentencepiece
from conversion import gemma
def gemma2_vocab(self):  # as Gemma3Model does without a tokenizer.model
    self._set_vocab_gpt2()
gemma.Gemma2Model.set_vocab = gemma2_vocab
for args in json.loads(sys.argv[2]):  # several outputs, one import of torch
    sys.argv = [str(conv), *args]
    runpy.run_path(str(conv), run_name="__main__")
"""


def convert_all(
    folder: Path, outs: dict[str, Path], converter: Path = CONVERTER
) -> dict[str, Path]:
    """`folder` through the converter once per outtype ({outtype: file}), one process;
    a failure raises with the converter's last output."""
    runs = [[str(folder), "--outtype", t, "--outfile", str(out)] for t, out in outs.items()]
    command = [sys.executable, "-c", RUN_CONVERTER, str(converter), json.dumps(runs)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{converter} failed:\n{done.stderr[-3000:]}")
    return outs


def convert(folder: Path, outtype: str, out: Path, converter: Path = CONVERTER) -> Path:
    return convert_all(folder, {outtype: out}, converter)[outtype]


def quantize(src: Path, dst: Path, kind: str, binary: Path = QUANTIZE) -> Path:
    """llama-quantize, as a llama.cpp user makes a Q4_K_M from an F32 file (one thread)."""
    done = subprocess.run(
        [str(binary), str(src), str(dst), kind, "1"], capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"{binary} failed:\n{done.stderr[-3000:]}")
    return dst
