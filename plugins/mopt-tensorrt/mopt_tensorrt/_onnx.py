"""ONNX artifact folders: which file is the graph, which files are its external weights, and
copying the rest (tokenizer, config) into a derived artifact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

#: the metadata file the `onnx` kind (mopt-ml) writes beside model.onnx
ML_META = "mopt_ml.json"


def find_onnx(folder: Path) -> Path:
    """`model.onnx`, else the only `*.onnx` file of `folder`."""
    p = folder / "model.onnx"
    if p.is_file():
        return p
    found = sorted(folder.glob("*.onnx"))
    if len(found) == 1:
        return found[0]
    raise FileNotFoundError(
        f"{folder} holds {'no' if not found else len(found)} .onnx files; expected model.onnx"
    )


def external_data_files(onnx_path: Path) -> list[str]:
    """Relative paths of the external-data files `onnx_path` references (reads the graph only)."""
    import onnx
    from onnx.external_data_helper import _get_all_tensors

    model = onnx.load(str(onnx_path), load_external_data=False)
    files = set()
    for t in _get_all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for kv in t.external_data:
                if kv.key == "location":
                    files.add(kv.value)
    return sorted(files)


def copy_companions(src: Path, dst: Path, graph_files: set[str]) -> list[str]:
    """Copy every top-level file of `src` except the graph and its weights into `dst`."""
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in graph_files and f.suffix != ".onnx":
            shutil.copyfile(f, dst / f.name)
            copied.append(f.name)
    return copied


def update_ml_meta(dst: Path, **changes: Any) -> None:
    """Rewrite fields of a copied `mopt_ml.json` (e.g. its precision) so it describes `dst`."""
    p = dst / ML_META
    if p.is_file():
        meta = json.loads(p.read_text())
        meta.update(changes)
        p.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def graph_io(onnx_path: Path) -> dict[str, list[dict[str, Any]]]:
    """Inputs (without initializers) and outputs of a graph: name, element type, dims
    (ints, or the symbolic name / None for dynamic ones)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}

    def describe(v: Any) -> dict[str, Any]:
        tt = v.type.tensor_type
        dims: list[Any] = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            else:
                dims.append(d.dim_param or None)
        return {"name": v.name, "elem_type": onnx.TensorProto.DataType.Name(tt.elem_type), "dims": dims}

    return {
        "inputs": [describe(v) for v in model.graph.input if v.name not in inits],
        "outputs": [describe(v) for v in model.graph.output],
    }
