"""Writing an exported graph: its structure in the .onnx file, its weights beside it.

Every graph the project writes for an engine to load (export's encoder.onnx / decoder.onnx,
and the int8 graphs a CPU loads with their weights flipped, runtime/cpu_int8.py) keeps its
weights in ONNX external data, one file beside the graph (io_names.weights_file). ONNX Runtime
then reads each weight from that file instead of keeping a parsed copy of the whole protobuf,
which lowers resident memory after loading (docs/design.md). The protobuf 2 GiB limit no
longer bounds the model size, and TensorRT's parse_from_file and onnx.load read the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from model import io_names

if TYPE_CHECKING:
    import onnx


def save_graph(proto: onnx.ModelProto, path: Path) -> Path:
    """Write `proto` to `path` with every initializer of 1 KiB or more in `path`'s weights file
    (io_names.weights_file). onnx appends to an existing weights file, so any earlier one goes
    first: saving twice gives the same two files. Like onnx.save_model, this moves the weights
    out of `proto` (it is left referring to the file)."""
    import onnx

    path = Path(path)
    data = path.with_name(io_names.weights_file(path.name))
    data.unlink(missing_ok=True)
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    return path


def externalize(path: Path) -> Path:
    """Re-save the graph at `path` (weights inline or external) with its weights external."""
    import onnx

    return save_graph(onnx.load(str(path)), path)
