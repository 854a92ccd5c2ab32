"""Regenerate the gRPC stubs of bitserve/api/proto from grpc_service.proto.

    python tools/grpc_proto.py [--out DIR]

The stubs are committed (serving needs grpcio and protobuf, not grpcio-tools); run this
after editing the .proto. Paths are given from the repository root, so the generated
`_grpc.py` imports its messages as `bitserve.api.proto.grpc_service_pb2`.
tests/server/test_grpc.py checks that the committed stubs are what this writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "bitserve/api/proto/grpc_service.proto"


def generate(out: Path) -> None:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"--python_out={out}", f"--pyi_out={out}"]
    args += [f"--grpc_python_out={out}", str(ROOT / PROTO)]
    if protoc.main(args) != 0:
        sys.exit(f"protoc failed on {PROTO}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write under")
    generate(parser.parse_args().out.resolve())


if __name__ == "__main__":
    main()
