"""Fetch llama.cpp's own HF -> GGUF converter (`convert_hf_to_gguf.py`) for bitserve.

The GGUF tests check bitserve against files written by llama.cpp's converter, which is
not on PyPI by itself: it ships inside the llama-cpp-python sdist, under
vendor/llama.cpp. This downloads that sdist with pip (no build, no install) and
extracts the converter, its `conversion/` package and its `gguf-py/` into
`~/.cache/bitserve/llama.cpp` (or `--dest`), where tests/llm/test_gguf.py looks;
`--source` also extracts the whole llama.cpp tree into `src/` there, for
tools/build_llama_quantize.sh. Only those entries are replaced: a `build/` beside them
(llama-quantize, llama-server) stays.

    .venv/bin/python tools/fetch_gguf_converter.py [--sdist llama_cpp_python-X.tar.gz] [--source]

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
VERSION = "0.3.36"  # the llama.cpp every GGUF test and benchmark was checked with
WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def download(folder: Path) -> Path:
    """The sdist, fetched by pip (only this package from source: no build of its deps)."""
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE]
    subprocess.run([*pip, f"{PACKAGE}=={VERSION}", "-d", str(folder), "-q"], check=True)
    return next(folder.glob("llama_cpp_python-*.tar.gz"))


def extract(sdist: Path, dest: Path, source: bool = False) -> None:
    """The converter's entries (and with `source` the whole tree, as src/) into dest,
    each replaced whole; nothing else in dest is touched."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            _, _, inner = member.name.partition("/vendor/llama.cpp/")
            if not inner or not (member.isfile() or member.isdir()):
                continue
            names = [inner] if inner.startswith(WANTED) else []
            names += [f"src/{inner}"] if source else []
            for name in names:
                member.name = name
                tar.extract(member, tmp, filter="data")
    if not (tmp / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{sdist}: no vendor/llama.cpp/convert_hf_to_gguf.py in it")
    dest.mkdir(parents=True, exist_ok=True)
    for entry in tmp.iterdir():
        old = dest / entry.name
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink(missing_ok=True)
        entry.rename(old)
    shutil.rmtree(tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEST)
    parser.add_argument("--sdist", type=Path, help="an already downloaded sdist")
    parser.add_argument("--source", action="store_true", help="the whole tree too, in src/")
    args = parser.parse_args()
    have = (args.dest / "convert_hf_to_gguf.py").is_file()
    if args.source:
        have = have and (args.dest / "src" / "CMakeLists.txt").is_file()
    if have and args.sdist is None:
        print(f"{args.dest}: already there")
        return
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or download(Path(tmp))
        extract(sdist, args.dest, args.source)
    print(f"llama.cpp's converter: {args.dest / 'convert_hf_to_gguf.py'}")


if __name__ == "__main__":
    main()
