"""The KServe v2 / Open Inference Protocol, HTTP/REST flavour: parse an infer request, build a response.

Pure functions, no web framework: every malformed request raises ``ProtocolError`` carrying the HTTP
status and a message that names the field and what was expected, so the server can answer 4xx and go
on. Supported: JSON tensor data (flat or nested lists) and the binary tensor data extension that the
official clients (tritonclient) use by default: the JSON header is followed by raw little-endian tensor
bytes, its length in the ``Inference-Header-Content-Length`` header, each binary input marked with
``parameters.binary_data_size``. Outputs are returned as binary when asked (``binary_data`` on a
requested output, or ``binary_data_output`` on the request); a string output is a BYTES tensor (JSON: a
list of strings; binary: each element a 4-byte little-endian length and its UTF-8 bytes, as tritonclient
reads it).

Parsing limits: JSON nested deeper than the parser's recursion limit is a 400 (never a RecursionError),
shape arithmetic is exact (Python integers: a product that would overflow int64 is compared, not wrapped),
and a declared shape is checked against the body's size and the caller's ``check_shape`` (the server's
per-request budget) before any array is allocated.

Spec: https://kserve.github.io/website/docs/concepts/architecture/data-plane/v2-protocol
"""

from __future__ import annotations

import json
import math
import reprlib
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# v2 datatype -> numpy dtype (BYTES is not a fixed-size type and no model input here uses it).
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
NUMPY_TO_V2 = {v: k for k, v in DATATYPES.items()}


class ProtocolError(ValueError):
    """A request the server refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TensorSpec:
    """What the model accepts: name, v2 datatype and shape with -1 for the batch dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass
class InferRequest:
    id: str | None
    tensor: np.ndarray  # the one model input, validated against the TensorSpec
    outputs: list[str]  # output names to return, in order
    binary_outputs: set[str] = field(default_factory=set)
    parameters: dict[str, Any] = field(default_factory=dict)


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo ``Content-Encoding: gzip|deflate`` without ever holding more than ``limit`` bytes."""
    if not encoding or encoding == "identity":
        return body
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(encoding.lower())
    if wbits is None:
        raise ProtocolError(f"Content-Encoding {encoding!r} is not supported (use gzip, deflate or none)", 415)
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as exc:
        raise ProtocolError(f"body is not valid {encoding} data: {exc}") from None
    if len(out) > limit:
        raise ProtocolError(f"decompressed body exceeds the limit of {limit} bytes", 413)
    if not d.eof:
        raise ProtocolError(f"body is truncated {encoding} data")
    return out


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """The JSON header (a dict) and the binary tail of a request body."""
    if header_length is None:
        json_part, tail = body, b""
    else:
        try:
            n = int(header_length)
        except ValueError:
            raise ProtocolError(
                f"header Inference-Header-Content-Length must be an integer, got {header_length!r}"
            ) from None
        if not 0 < n <= len(body):
            raise ProtocolError(
                f"header Inference-Header-Content-Length is {n} but the body has {len(body)} bytes"
            ) from None
        json_part, tail = body[:n], body[n:]
    if not json_part.strip():
        raise ProtocolError("empty request body: expected a JSON inference request")
    try:
        header = json.loads(json_part)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError(
            "request body is JSON nested too deeply (an inference request needs a few levels)"
        ) from None
    return _obj(header, "request body"), tail


def _shape(raw: Any, where: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in raw):
        raise ProtocolError(f"{where}.shape must be a list of integers, got {reprlib.repr(raw)}")
    if any(d < 0 for d in raw):
        raise ProtocolError(f"{where}.shape must not have negative dimensions, got {raw}")
    return tuple(raw)


def _json_data(raw: Any, dtype: np.dtype, shape: tuple[int, ...], where: str) -> np.ndarray:
    if not isinstance(raw, list):
        raise ProtocolError(f"{where}.data must be a list, got {type(raw).__name__}")
    try:
        arr = np.asarray(raw)
    except (ValueError, OverflowError):  # ragged, or deeper than numpy's 64 dimensions
        raise ProtocolError(f"{where}.data is a ragged or too deeply nested list") from None
    count = math.prod(shape)
    if arr.size != count:
        raise ProtocolError(f"{where}.data has {arr.size} elements but shape {list(shape)} needs {count}")
    want = "b" if dtype.kind == "b" else "biuf"
    if arr.size and arr.dtype.kind not in want:
        kind = "booleans" if dtype.kind == "b" else "numbers"
        raise ProtocolError(f"{where}.data must hold only {kind}, found {arr.dtype.kind!r}-type values")
    if dtype.kind in "ui" and arr.size:
        info = np.iinfo(dtype)
        if np.any(arr != np.round(arr)) or arr.min() < info.min or arr.max() > info.max:
            raise ProtocolError(f"{where}.data must be integers in [{info.min}, {info.max}] for {dtype.name}")
    return arr.astype(dtype).reshape(shape)


ShapeCheck = Callable[[tuple[int, ...]], None]  # a declared (N, ...) shape -> None, or raise ProtocolError


def parse_infer_request(
    header: dict[str, Any],
    tail: bytes,
    spec: TensorSpec,
    output_names: list[str],
    max_batch_size: int,
    check_shape: ShapeCheck | None = None,
) -> InferRequest:
    """Validate a v2 infer request for a model with one input ``spec``; return the input tensor.

    ``check_shape`` sees the declared shape once it matches the spec, before the data is read."""
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError(f"id must be a string, got {type(request_id).__name__}")
    params = _obj(header.get("parameters", {}), "parameters")
    unknown = sorted(set(header) - {"id", "parameters", "inputs", "outputs"})
    if unknown:
        raise ProtocolError(f"unknown field {unknown[0]!r} in the request (expected id, parameters, inputs, outputs)")
    inputs = header.get("inputs")
    if inputs is None:
        raise ProtocolError("missing field 'inputs'")
    if not isinstance(inputs, list) or not inputs:
        raise ProtocolError("field 'inputs' must be a non-empty list")
    if len(inputs) != 1:
        names = [i.get("name") if isinstance(i, dict) else i for i in inputs]
        raise ProtocolError(f"this model takes exactly one input {spec.name!r}, got {len(inputs)}: {names}")
    tensor = _input_tensor(_obj(inputs[0], "inputs[0]"), tail, spec, max_batch_size, check_shape)
    outputs, binary = _requested_outputs(header, params, output_names)
    return InferRequest(request_id, tensor, outputs, binary, params)


def _input_tensor(
    raw: dict[str, Any], tail: bytes, spec: TensorSpec, max_batch_size: int, check_shape: ShapeCheck | None
) -> np.ndarray:
    """The one input as an array of the spec's dtype, shape (N, ...) with 1 <= N <= ``max_batch_size``.

    Its data is either the JSON ``data`` list or, with ``parameters.binary_data_size``, the binary tail.
    """
    name = raw.get("name")
    where = f"input {name!r}" if isinstance(name, str) else "inputs[0]"
    if not isinstance(name, str):
        raise ProtocolError("inputs[0].name must be a string")
    if name != spec.name:
        raise ProtocolError(f"unknown input {name!r}: this model's input is {spec.name!r}")
    shape, dtype = _declared_shape(raw, spec, where, max_batch_size)
    if check_shape is not None:
        check_shape(shape)
    in_params = _obj(raw.get("parameters", {}), f"{where}.parameters")
    if "binary_data_size" in in_params:
        size = in_params["binary_data_size"]
        need = math.prod(shape) * dtype.itemsize
        if not isinstance(size, int) or isinstance(size, bool) or size != need:
            raise ProtocolError(f"{where}.parameters.binary_data_size is {size!r} but shape {list(shape)} needs {need}")
        if "data" in raw:
            raise ProtocolError(f"{where} has both 'data' and binary_data_size: send one")
        if len(tail) != size:
            raise ProtocolError(f"{where}: binary_data_size is {size} but {len(tail)} bytes follow the JSON header")
        return np.frombuffer(tail, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False).reshape(shape)
    if tail:
        raise ProtocolError(f"{len(tail)} bytes follow the JSON header but no input declares binary_data_size")
    if "data" not in raw:
        raise ProtocolError(f"{where}: missing field 'data' (or parameters.binary_data_size)")
    return _json_data(raw["data"], dtype, shape, where)


def _declared_shape(
    raw: dict[str, Any], spec: TensorSpec, where: str, max_batch_size: int
) -> tuple[tuple[int, ...], np.dtype]:
    """The input's declared shape and dtype, checked against the spec (-1: any size) and the batch limit."""
    for key in ("shape", "datatype"):
        if key not in raw:
            raise ProtocolError(f"{where}: missing field {key!r}")
    shape = _shape(raw["shape"], where)
    datatype = raw["datatype"]
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise ProtocolError(f"{where}.datatype {datatype!r} is not a v2 datatype ({', '.join(DATATYPES)})")
    if datatype != spec.datatype:
        raise ProtocolError(f"{where}.datatype is {datatype} but the model takes {spec.datatype}")
    if len(shape) != len(spec.shape):
        raise ProtocolError(f"{where}.shape {list(shape)} has rank {len(shape)}, expected {list(spec.shape)}")
    if any(want not in (-1, got) for want, got in zip(spec.shape, shape, strict=True)):
        raise ProtocolError(f"{where}.shape {list(shape)} does not match the model's {list(spec.shape)}")
    if shape[0] == 0:
        raise ProtocolError(f"{where}.shape has a batch size of 0")
    if shape[0] > max_batch_size:
        raise ProtocolError(f"{where}.shape has a batch size of {shape[0]}, the server's maximum is {max_batch_size}")
    if 0 in shape[1:]:  # a model taking photographs of any size (-1 dimensions) still needs pixels
        raise ProtocolError(f"{where}.shape {list(shape)} has an empty dimension")
    return shape, DATATYPES[datatype]


def _requested_outputs(
    header: dict[str, Any], params: dict[str, Any], output_names: list[str]
) -> tuple[list[str], set[str]]:
    """The outputs to return, in order (default: all), and which of them go back as binary."""
    outputs, binary = list(output_names), set()
    if params.get("binary_data_output") is True:
        binary = set(output_names)
    if "outputs" in header:
        wanted = header["outputs"]
        if not isinstance(wanted, list):
            raise ProtocolError("field 'outputs' must be a list")
        outputs = []
        for i, out in enumerate(wanted):
            out = _obj(out, f"outputs[{i}]")
            oname = out.get("name")
            if oname not in output_names:
                raise ProtocolError(f"outputs[{i}]: unknown output {oname!r} (this model has {output_names})")
            outputs.append(oname)
            if _obj(out.get("parameters", {}), f"outputs[{i}].parameters").get("binary_data") is True:
                binary.add(oname)
    return outputs, binary


def infer_response(
    model_name: str,
    model_version: str,
    request: InferRequest,
    results: dict[str, np.ndarray],
    parameters: dict[str, str | float | int | bool] | None = None,
) -> tuple[bytes, int | None]:
    """The response body, and the JSON header length when binary outputs follow it (else None).

    ``results`` holds numeric arrays and string arrays (numpy ``str`` or object dtype: v2 BYTES);
    ``parameters`` are the response's own (the spec allows scalar values only)."""
    outputs, blobs = [], []
    for name in request.outputs:
        arr = results[name]
        strings = arr.dtype.kind in "OUS"
        if strings:
            items = [str(v).encode() for v in arr.reshape(-1)]
            entry: dict[str, Any] = {"name": name, "datatype": "BYTES", "shape": list(arr.shape)}
        else:
            arr = np.ascontiguousarray(arr)
            entry = {"name": name, "datatype": NUMPY_TO_V2[arr.dtype], "shape": list(arr.shape)}
        if name in request.binary_outputs:
            if strings:
                blob = b"".join(struct.pack("<I", len(b)) + b for b in items)
            else:
                blob = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = [b.decode() for b in items] if strings else arr.reshape(-1).tolist()
        outputs.append(entry)
    body: dict[str, Any] = {"model_name": model_name, "model_version": model_version, "outputs": outputs}
    if request.id is not None:
        body["id"] = request.id
    if parameters:
        body["parameters"] = parameters
    head = json.dumps(body).encode()
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)
