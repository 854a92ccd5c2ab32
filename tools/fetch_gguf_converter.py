"""Fetch llama.cpp's own HF -> GGUF converter (`convert_hf_to_gguf.py`) for bitserve.

The GGUF tests check bitserve against files written by llama.cpp's converter, which is
not on PyPI by itself: it ships inside the llama-cpp-python sdist, under
vendor/llama.cpp. This downloads that sdist with pip (no build, no install) and
extracts the converter, its `conversion/` package and its `gguf-py/` into
`~/.cache/bitserve/llama.cpp` (or `--dest`), where tests/llm/test_gguf.py looks.

    .venv/bin/python tools/fetch_gguf_converter.py [--sdist llama_cpp_python-X.tar.gz]

`make` runs it when it builds the venv; without network the GGUF conversion tests skip.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

DEST = Path.home() / ".cache" / "bitserve" / "llama.cpp"
PACKAGE = "llama-cpp-python"
WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def download(folder: Path) -> Path:
    """The sdist, fetched by pip (only this package from source: no build of its deps)."""
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE]
    subprocess.run([*pip, PACKAGE, "-d", str(folder), "-q"], check=True)
    return next(folder.glob("llama_cpp_python-*.tar.gz"))


def extract(sdist: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            _, _, inner = member.name.partition("/vendor/llama.cpp/")
            if inner and inner.startswith(WANTED) and (member.isfile() or member.isdir()):
                member.name = inner
                tar.extract(member, tmp, filter="data")
    if not (tmp / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{sdist}: no vendor/llama.cpp/convert_hf_to_gguf.py in it")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEST)
    parser.add_argument("--sdist", type=Path, help="an already downloaded sdist")
    args = parser.parse_args()
    if (args.dest / "convert_hf_to_gguf.py").is_file() and args.sdist is None:
        print(f"{args.dest}: already there")
        return
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or download(Path(tmp))
        extract(sdist, args.dest)
    print(f"llama.cpp's converter: {args.dest / 'convert_hf_to_gguf.py'}")


if __name__ == "__main__":
    main()
