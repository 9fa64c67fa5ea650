"""A Python gRPC client for TorchServe's inference and management APIs, with the token as call metadata.

The stubs are generated with grpcio-tools from the ``.proto`` files inside the installed TorchServe's frontend
jar, into a cache directory keyed by TorchServe's version. They are never copied into the repository.

  .venv/bin/python -m benchmarks.grpc_client --model minilm '{"text": "hello world"}'    # against scripts/start.sh

The tests call TorchServe over gRPC with its ``Client`` (tests/test_torchserve.py, tests/test_production.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from handlers.serving import server as torchserve

PROTOS = ("inference.proto", "management.proto", "open_inference_grpc.proto")
MODULES = tuple(f"{name.removesuffix('.proto')}{suffix}" for name in PROTOS for suffix in ("_pb2", "_pb2_grpc"))


def stubs(cache: Path | None = None) -> dict[str, ModuleType]:
    """inference_pb2(_grpc), management_pb2(_grpc), open_inference_grpc_pb2(_grpc): generated once per TorchServe
    version into ``cache`` (default ~/.cache/pt2-handlers/grpc-stubs-<version>) and imported."""
    import google.rpc
    import grpc_tools
    import ts
    from grpc_tools import protoc

    version = importlib.metadata.version("torchserve")
    out = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pt2-handlers" / \
        f"grpc-stubs-{version}"
    if not all((out / f"{name.removesuffix('.proto')}_pb2_grpc.py").is_file() for name in PROTOS):
        out.mkdir(parents=True, exist_ok=True)
        jar = Path(ts.__file__).parent / "frontend" / "model-server.jar"
        with zipfile.ZipFile(jar) as archive:
            for name in PROTOS:
                (out / name).write_bytes(archive.read(name))
        includes = [Path(grpc_tools.__file__).parent / "_proto",  # google/protobuf/empty.proto
                    Path(google.rpc.__path__[0]).parent.parent]  # google/rpc/status.proto
        args = ["protoc", f"-I{out}", *(f"-I{path}" for path in includes), f"--python_out={out}",
                f"--grpc_python_out={out}", *(str(out / name) for name in PROTOS)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"grpc_tools.protoc failed on {PROTOS} from {jar}")
    if str(out) not in sys.path:
        sys.path.insert(0, str(out))
    return {name: importlib.import_module(name) for name in MODULES}


class Client:
    """Predictions and management calls over gRPC; ``key(kind)`` gives the token for "inference"/"management"
    (None: call without one)."""

    def __init__(self, host: str, inference_port: int, management_port: int, key: Any):
        import grpc

        self.modules = stubs()
        self.key = key
        self._channels = [grpc.insecure_channel(f"{host}:{port}") for port in (inference_port, management_port)]
        self.inference = self.modules["inference_pb2_grpc"].InferenceAPIsServiceStub(self._channels[0])
        self.management = self.modules["management_pb2_grpc"].ManagementAPIsServiceStub(self._channels[1])
        # Open Inference Protocol (KServe v2) over gRPC: on the inference port when ts_open_inference_protocol=true.
        self.open_inference = self.modules["open_inference_grpc_pb2_grpc"].GRPCInferenceServiceStub(self._channels[0])

    @classmethod
    def for_server(cls, config: Path, run_dir: Path, key: Any = None) -> Client:
        props = torchserve.read_properties(config)
        server = torchserve.server_for(config, run_dir)
        return cls(props.get("grpc_inference_address", "127.0.0.1"), int(props.get("grpc_inference_port", 7070)),
                   int(props.get("grpc_management_port", 7071)), key or server.key)

    def _metadata(self, kind: str) -> list[tuple[str, str]]:
        token = self.key(kind)
        return [] if token is None else [("authorization", f"Bearer {token}")]

    def predict(self, model: str, body: bytes, timeout: float = 120) -> bytes:
        request = self.modules["inference_pb2"].PredictionsRequest(model_name=model, input={"data": body})
        return self.inference.Predictions(request, metadata=self._metadata("inference"), timeout=timeout).prediction

    def stream_predict(self, model: str, body: bytes, timeout: float = 300) -> Iterator[bytes]:
        """Each message of a streamed answer as it arrives (pt2-handlers: one JSON line per token, then the
        answer)."""
        request = self.modules["inference_pb2"].PredictionsRequest(model_name=model, input={"data": body})
        for message in self.inference.StreamPredictions(request, metadata=self._metadata("inference"),
                                                        timeout=timeout):
            yield message.prediction

    def model_infer(self, model: str, texts: dict[str, list[str]], request_id: str = "",
                    timeout: float = 120) -> dict[str, dict[str, Any]]:
        """A v2 ModelInfer with one BYTES tensor per input name; the outputs as {name: {shape, datatype, data}}."""
        pb2 = self.modules["open_inference_grpc_pb2"]
        inputs = [pb2.ModelInferRequest.InferInputTensor(
            name=name, datatype="BYTES", shape=[len(values)],
            contents=pb2.InferTensorContents(bytes_contents=[value.encode() for value in values]))
            for name, values in texts.items()]
        answer = self.open_inference.ModelInfer(pb2.ModelInferRequest(model_name=model, id=request_id, inputs=inputs),
                                                metadata=self._metadata("inference"), timeout=timeout)
        contents = {"BYTES": "bytes_contents", "FP32": "fp32_contents", "INT64": "int64_contents",
                    "BOOL": "bool_contents"}
        return {output.name: {"shape": list(output.shape), "datatype": output.datatype,
                              "data": _values(output.datatype, getattr(output.contents, contents[output.datatype]))}
                for output in answer.outputs}

    def _manage(self, rpc: str, request_type: str, timeout: float, **fields: Any) -> str:
        request = getattr(self.modules["management_pb2"], request_type)(**fields)
        return getattr(self.management, rpc)(request, metadata=self._metadata("management"), timeout=timeout).msg

    def register(self, archive: str, name: str, workers: int = 1, timeout: float = 900) -> str:
        return self._manage("RegisterModel", "RegisterModelRequest", timeout, url=archive, model_name=name,
                            initial_workers=workers, synchronous=True)

    def scale(self, model: str, min_workers: int, max_workers: int, timeout: float = 900) -> str:
        return self._manage("ScaleWorker", "ScaleWorkerRequest", timeout, model_name=model, min_worker=min_workers,
                            max_worker=max_workers, synchronous=True)

    def unregister(self, model: str, timeout: float = 120) -> str:
        return self._manage("UnregisterModel", "UnregisterModelRequest", timeout, model_name=model)

    def describe(self, model: str, timeout: float = 60) -> Any:
        request = self.modules["management_pb2"].DescribeModelRequest(model_name=model, customized=True)
        answer = self.management.DescribeModel(request, metadata=self._metadata("management"), timeout=timeout)
        return json.loads(answer.msg)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def _values(datatype: str, contents: Any) -> list[Any]:
    """A tensor's elements. TorchServe's gRPC bridge writes each BYTES element as JSON text (a string arrives in
    quotes), so BYTES elements are read back as JSON."""
    if datatype == "BYTES":
        return [json.loads(value.decode("utf-8")) for value in contents]
    return list(contents)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpc_client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("body", help="the request body, e.g. '{\"text\": \"hello\"}'")
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--config", type=Path, default=torchserve.DEFAULT_CONFIG)
    parser.add_argument("--run-dir", type=Path, default=torchserve.DEFAULT_RUN_DIR)
    args = parser.parse_args()
    client = Client.for_server(args.config, args.run_dir.resolve())
    try:
        print(client.predict(args.model, args.body.encode()).decode())
    finally:
        client.close()


if __name__ == "__main__":
    main()
