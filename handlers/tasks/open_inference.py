"""The Open Inference Protocol (KServe v2) for every task: a v2 request becomes the task's own JSON body, the
task's answer becomes v2 output tensors.

A KServe client posts ``{"id", "parameters", "inputs": [{"name", "shape", "datatype": "BYTES", "data"}]}`` to
``/v2/models/NAME/infer`` (TorchServe routes it to the model like ``/predictions/NAME``). Each request is read on
its own, so TorchServe's server-side batching keeps working (TorchServe's ``service_envelope=kservev2`` reads only
the first request of a batch and the first string of each input; do not set it). Request ``parameters`` are the
task's own options (``top_k``, ``max_new_tokens``, ...); each task names the inputs it reads
(``Task.from_open_inference``). Answers become tensors column by column: a list of equal-length number lists is
one numeric tensor ``[n, d]``; rows of records (``{"label", "score"}``) give one tensor per field, ``[n]`` or
``[n, k]``; anything ragged is one BYTES tensor of JSON strings, one per row.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from handlers.errors import HandlerError, InvalidInput

REQUEST_KEYS = ("id", "parameters", "inputs", "outputs")
# TorchServe's gRPC ModelInfer (ts_open_inference_protocol=true) passes the request on as this JSON with the
# model's name added, and each BYTES element base64-encoded. A REST body names the model in its URL, never here.
ROUTING_KEYS = ("model_name", "model_version")
INPUT_KEYS = ("name", "shape", "datatype", "data", "parameters")
# Per-input parameters a KServe client may send with text; they describe what BYTES already says.
IGNORED_INPUT_PARAMETERS = ("content_type",)


# The protocol's numeric datatypes and the torch dtype of each (BYTES is text).
NUMERIC_DATATYPES = {"BOOL": "bool", "UINT8": "uint8", "INT8": "int8", "INT16": "int16", "INT32": "int32",
                     "INT64": "int64", "FP16": "float16", "FP32": "float32", "FP64": "float64"}


@dataclass(frozen=True)
class InferRequest:
    """One v2 request: its inputs' elements by name (row-major, as flat lists), their shapes and datatypes, the task
    options, what to return."""

    id: str | None
    values: dict[str, list[Any]]
    parameters: dict[str, Any]
    outputs: tuple[str, ...] | None  # None: every output
    shapes: dict[str, list[int]] = field(default_factory=dict, compare=False)
    datatypes: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def texts(self) -> dict[str, list[str]]:
        """The BYTES inputs' strings, by name."""
        return {name: values for name, values in self.values.items() if self.datatypes.get(name, "BYTES") == "BYTES"}


def is_request(body: Any) -> bool:
    """A v2 body: an object whose ``inputs`` are tensor objects (the tasks' own ``inputs`` hold text or pairs)."""
    if not isinstance(body, Mapping):
        return False
    inputs = body.get("inputs")
    return (isinstance(inputs, list) and bool(inputs) and all(isinstance(item, Mapping) for item in inputs)
            and any("datatype" in item for item in inputs))


def parse_request(body: Mapping[str, Any], numeric: bool = False) -> InferRequest:
    """The v2 body checked against the protocol; InvalidInput naming the first problem. ``numeric``: the model reads
    tensors of numbers (else BYTES only)."""
    unknown = sorted(str(key) for key in body if key not in REQUEST_KEYS + ROUTING_KEYS)
    if unknown:
        raise InvalidInput(f"unknown key(s) {', '.join(unknown)} in an inference request; the protocol allows "
                           f"{', '.join(REQUEST_KEYS)}")
    request_id = body.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput(f'"id" must be a string, got {type(request_id).__name__}')
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, Mapping):
        raise InvalidInput(f'"parameters" must be an object, got {type(parameters).__name__}')
    values: dict[str, list[Any]] = {}
    shapes: dict[str, list[int]] = {}
    datatypes: dict[str, str] = {}
    from_grpc = "model_name" in body
    for index, tensor in enumerate(body["inputs"]):
        name, elements = _input(tensor, f'"inputs"[{index}]', from_grpc, numeric)
        if name in values:
            raise InvalidInput(f'input "{name}" is given twice')
        values[name], shapes[name], datatypes[name] = elements, list(tensor["shape"]), tensor["datatype"]
    return InferRequest(request_id, values, dict(parameters), _requested_outputs(body.get("outputs")), shapes,
                        datatypes)


def _input(tensor: Mapping[str, Any], where: str, from_grpc: bool, numeric: bool) -> tuple[str, list[Any]]:
    unknown = sorted(str(key) for key in tensor if key not in INPUT_KEYS)
    if unknown:
        raise InvalidInput(f"unknown key(s) {', '.join(unknown)} in {where}; allowed: {', '.join(INPUT_KEYS)}")
    missing = [key for key in ("name", "shape", "datatype", "data") if key not in tensor]
    if missing:
        raise InvalidInput(f"{where} has no {', '.join(missing)}")
    name, shape, datatype = tensor["name"], tensor["shape"], tensor["datatype"]
    if not isinstance(name, str) or not name:
        raise InvalidInput(f'{where}: "name" must be a non-empty string')
    where = f'input "{name}"'
    _check_datatype(datatype, numeric, where)
    if (not isinstance(shape, list) or not shape
            or not all(isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in shape)):
        raise InvalidInput(f'{where}: "shape" must be a non-empty list of non-negative integers, got {shape!r}')
    parameters = tensor.get("parameters") or {}
    extra = sorted(str(key) for key in parameters if key not in IGNORED_INPUT_PARAMETERS) \
        if isinstance(parameters, Mapping) else ["(not an object)"]
    if extra:
        raise InvalidInput(f"{where}: parameters {', '.join(extra)} are not supported (binary tensor data is not: "
                           "send the strings in \"data\")")
    values = _flatten(tensor["data"])
    if len(values) != math.prod(shape):
        raise InvalidInput(f"{where} has shape {shape} ({math.prod(shape)} elements) but {len(values)} in \"data\"")
    if datatype != "BYTES":
        return name, _numbers_of(values, datatype, where)
    bad = next((i for i, value in enumerate(values) if not isinstance(value, str)), None)
    if bad is not None:
        raise InvalidInput(f"{where}: element {bad} of \"data\" is {type(values[bad]).__name__}; BYTES elements are "
                           "strings")
    return name, [_from_base64(value, where, index) for index, value in enumerate(values)] if from_grpc else values


def _check_datatype(datatype: Any, numeric: bool, where: str) -> None:
    if datatype != "BYTES" and not numeric:
        raise InvalidInput(f'{where} has datatype {datatype!r}; this model reads text: send "BYTES" (UTF-8 strings)')
    if datatype != "BYTES" and datatype not in NUMERIC_DATATYPES:
        raise InvalidInput(f'{where} has datatype {datatype!r}; use one of {", ".join(NUMERIC_DATATYPES)}')


def _numbers_of(values: list[Any], datatype: str, where: str) -> list[Any]:
    numbers = (bool,) if datatype == "BOOL" else (int, float)
    bad = next((i for i, value in enumerate(values) if not isinstance(value, numbers)
                or (datatype != "BOOL" and isinstance(value, bool))), None)
    if bad is not None:
        raise InvalidInput(f"{where}: element {bad} of \"data\" is {type(values[bad]).__name__}; {datatype} "
                           f"elements are {'true/false' if datatype == 'BOOL' else 'numbers'}")
    return values


def _from_base64(value: str, where: str, index: int) -> str:
    try:
        return base64.b64decode(value, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{where}: element {index} is not UTF-8 text ({exc})") from None


def _flatten(data: Any) -> list[Any]:
    """Row-major elements of ``data`` (the protocol allows nested lists matching the shape, or a flat list)."""
    if not isinstance(data, list):
        return [data]
    flat: list[Any] = []
    for item in data:
        flat.extend(_flatten(item) if isinstance(item, list) else [item])
    return flat


def _requested_outputs(outputs: Any) -> tuple[str, ...] | None:
    if outputs is None:
        return None
    if not isinstance(outputs, list) or not all(isinstance(item, Mapping) and isinstance(item.get("name"), str)
                                                for item in outputs):
        raise InvalidInput('"outputs" must be a list of {"name": ...} objects')
    return tuple(item["name"] for item in outputs)


def only_input(texts: Mapping[str, list[str]], task: str) -> list[str]:
    """The strings of the one input a single-text task reads, whatever its name; InvalidInput otherwise."""
    if len(texts) != 1:
        raise InvalidInput(f"{task} reads one BYTES input (any name); got {len(texts)}: {', '.join(texts)}")
    return next(iter(texts.values()))


def with_options(body: dict[str, Any], parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A task body plus the request's parameters as the task's options; a parameter may not replace the texts."""
    clash = sorted(key for key in parameters if key in body)
    if clash:
        raise InvalidInput(f"parameter(s) {', '.join(clash)} would replace the inputs; send texts as inputs")
    return {**body, **parameters}


def response(request: InferRequest, outputs: list[dict[str, Any]], model_name: str,
             model_version: str | None) -> dict[str, Any]:
    """The v2 response: the requested outputs (all by default), with the request's id echoed."""
    if request.outputs is not None:
        by_name = {output["name"]: output for output in outputs}
        missing = [name for name in request.outputs if name not in by_name]
        if missing:
            raise InvalidInput(f"unknown output(s) {', '.join(missing)}; this answer has "
                               f"{', '.join(by_name) or 'none'}")
        outputs = [by_name[name] for name in request.outputs]
    answer: dict[str, Any] = {"model_name": model_name}
    if model_version:
        answer["model_version"] = model_version
    if request.id is not None:
        answer["id"] = request.id
    answer["outputs"] = outputs
    return answer


def to_tensors(name: str, rows: Sequence[Any], record_lists: bool = False) -> list[dict[str, Any]]:
    """Output tensors for one answer's rows (one row per input element); see the module docstring.
    ``record_lists``: rows that are lists of records become ``[n, k]`` columns; a task says so only where k is
    fixed by the request (e.g. ``top_k`` labels), so the shape never depends on what the model answered."""
    rows = list(rows)
    if rows and all(_numbers(row) for row in rows) and len({len(row) for row in rows}) == 1:
        return [_tensor(name, [len(rows), len(rows[0])], [value for row in rows for value in row])]
    records, shape = _records(rows, record_lists)
    if records is not None:
        return [_column(field, shape, [record[field] for record in records]) for field in records[0]]
    return [json_rows(name, rows)]


def json_rows(name: str, rows: Sequence[Any]) -> dict[str, Any]:
    """One BYTES tensor ``[n]``: each row as JSON text (for answers whose rows differ in length)."""
    return {"name": name, "shape": [len(rows)], "datatype": "BYTES", "data": [json.dumps(row) for row in rows]}


def _records(rows: list[Any], record_lists: bool) -> tuple[list[Mapping[str, Any]] | None, list[int]]:
    """The rows as records with the same fields, and their shape: ``[n]`` for one record per row, ``[n, k]`` for
    k per row; None if the rows are not like that."""
    if rows and all(isinstance(row, Mapping) for row in rows):
        records, shape = rows, [len(rows)]
    elif (record_lists and rows and all(isinstance(row, list) and row and all(isinstance(item, Mapping) for item in row)
                       for row in rows) and len({len(row) for row in rows}) == 1):
        records, shape = [item for row in rows for item in row], [len(rows), len(rows[0])]
    else:
        return None, []
    fields = list(records[0])
    if not fields or any(list(record) != fields for record in records):
        return None, []
    return records, shape


def _column(name: str, shape: list[int], values: list[Any]) -> dict[str, Any]:
    if all(isinstance(value, (str, bool, int, float)) for value in values):
        return _tensor(name, shape, values)
    return _tensor(name, shape, [json.dumps(value) for value in values])  # nested: JSON text per element


def _tensor(name: str, shape: list[int], data: list[Any]) -> dict[str, Any]:
    if all(isinstance(value, str) for value in data):
        datatype = "BYTES"
    elif all(isinstance(value, bool) for value in data):
        datatype = "BOOL"
    elif all(isinstance(value, int) and not isinstance(value, bool) for value in data):
        datatype = "INT64"
    elif all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in data):
        datatype = "FP32"
    else:  # mixed kinds in one column: keep each element exact as JSON text
        datatype, data = "BYTES", [json.dumps(value) for value in data]
    return {"name": name, "shape": shape, "datatype": datatype, "data": data}


def _numbers(row: Any) -> bool:
    return (isinstance(row, list) and bool(row)
            and all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in row))


class OpenInferenceError(HandlerError):
    """A request's error in the protocol's shape, ``{"error": message}`` (plus our code and type)."""

    def __init__(self, cause: HandlerError):
        super().__init__(cause.message)
        self.status = cause.status
        self.cause_type = type(cause).__name__

    def to_json(self) -> dict:
        return {"error": self.message, "code": self.status, "type": self.cause_type}
