"""Decodes wire requests with bitserve's v2 codec in a process of its own (test_v2_codec.py
builds them with tritonclient, whose gRPC protos cannot share a process with bitserve's).

stdin: JSON {"config": {...}, "cases": [{"http": [b64 body, json_size], "grpc": b64}]};
stdout: per case and wire, the decoded request or the error's message.
"""

from __future__ import annotations

import base64
import json
import sys

from bitserve.api.proto import grpc_service_pb2 as pb
from bitserve.api.v2 import parse_grpc_infer, parse_infer
from bitserve.config import ModelConfig
from bitserve.inference import InvalidRequest


def described(decode) -> dict:
    try:
        request = decode()
    except InvalidRequest as e:
        return {"error": str(e)}
    inputs = {}
    for name, array in request.inputs.items():
        values = [v.decode("latin-1") for v in array.reshape(-1)] if array.dtype == object else None
        raw = "" if values is not None else base64.b64encode(array.tobytes()).decode()
        inputs[name] = [array.dtype.str, list(array.shape), raw, values]
    return {
        "inputs": inputs,
        "rows": request.rows,
        "shape_key": repr(request.shape_key),
        "outputs": request.outputs,
        "classification": request.classification,
        "id": request.id,
        "priority": request.priority,
        "timeout_us": request.timeout_us,
    }


def main() -> None:
    job = json.load(sys.stdin)
    config = ModelConfig.model_validate(job["config"])
    results = []
    for case in job["cases"]:
        body, json_size = case["http"]
        body = base64.b64decode(body)
        message = pb.ModelInferRequest.FromString(base64.b64decode(case["grpc"]))
        results.append(
            {
                "http": described(lambda: parse_infer(config, body, json_size)),  # noqa: B023
                "grpc": described(lambda: parse_grpc_infer(config, message, None)),  # noqa: B023
            }
        )
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
