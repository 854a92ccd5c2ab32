"""Regenerate the gRPC stubs of bitserve/api/proto from grpc_service.proto.

    python tools/grpc_proto.py [--out DIR]

The stubs are committed (serving needs grpcio and protobuf, not grpcio-tools); run this
after editing the .proto. Paths are given from the repository root, so the generated
`_grpc.py` imports its messages as `bitserve.api.proto.grpc_service_pb2`.
tests/server/test_grpc.py checks that the committed stubs are what this writes.

The messages are built in a descriptor pool of their own, not protobuf's default one:
tritonclient registers the same `inference.*` names there, and protobuf refuses a name
twice, so a process that imports both (a test, a bench, a user's Python model calling
Triton) would fail on whichever came second. Only the names live in the pool; the wire
format and the service's method paths are the same.
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
    messages = out / PROTO.replace(".proto", "_pb2.py")
    text = messages.read_text()
    default = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
    if text.count(default) != 1:
        sys.exit(f"{messages}: protoc's output no longer adds its file to the default pool")
    private = "_POOL = _descriptor_pool.DescriptorPool()\nDESCRIPTOR = _POOL.AddSerializedFile("
    messages.write_text(text.replace(default, private))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write under")
    generate(parser.parse_args().out.resolve())


if __name__ == "__main__":
    main()
