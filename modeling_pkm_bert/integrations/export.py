"""`torch.export` and ONNX export of BertPkm models (any head), with dynamic batch and sequence sizes.

Under `torch.export` a memory looks up every token and zeroes the outputs of padding (no data-dependent token
selection; exact in eval mode, where the query BatchNorm normalises with its running statistics), and the top-k search
runs in torch ops, never in the native selection op `torch.ops.pkm_bert.select_product_keys`: the exported program and
its ONNX file hold standard ops only and run where this package is not installed.
"""

import os
import shutil
import tempfile
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn


def _check_inputs(model: nn.Module, example_inputs: Mapping, dynamic: bool) -> dict:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if model.training:
        raise ValueError(
            f"{type(model).__name__} is in training mode: export it in eval mode (model.eval()), where the memories' "
            "query BatchNorm uses its running statistics and dropout is off"
        )
    if not isinstance(example_inputs, Mapping) or not example_inputs:
        raise ValueError("example_inputs must be a non-empty dict of tensors, e.g. a tokenizer's output")
    inputs = dict(example_inputs)
    not_tensors = sorted(name for name, value in inputs.items() if not isinstance(value, torch.Tensor))
    if not_tensors:
        raise ValueError(f"example_inputs {not_tensors} are not tensors")
    if dynamic:
        small = sorted(name for name, value in inputs.items() if value.dim() < 2 or min(value.shape) < 2)
        if small:
            raise ValueError(
                f"example_inputs {small} need at least 2 dimensions of size >= 2 for a dynamic export (torch.export "
                "specialises sizes 0 and 1): use a batch of 2 or more sequences of 2 or more tokens"
            )
    return inputs


@contextmanager
def _without_cache(model: nn.Module):
    """The forward pass alone, without a cache object among the outputs (a causal LM's `generate` exports with
    transformers' `exporters.DynamoExporter().export_for_generation`)."""
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if use_cache:
        config.use_cache = False
    try:
        yield
    finally:
        if use_cache:
            config.use_cache = use_cache


def dynamic_shapes(example_inputs: Mapping[str, torch.Tensor]) -> dict:
    """Dynamic batch (first) and sequence (last) axes for every input, e.g. `input_ids` (batch, sequence) or a
    multiple-choice `(batch, choices, sequence)`."""
    return {
        name: {0: torch.export.Dim.DYNAMIC, value.dim() - 1: torch.export.Dim.DYNAMIC} for name, value in example_inputs.items()
    }


def export_program(
    model: nn.Module, example_inputs: Mapping[str, torch.Tensor], dynamic: bool = True
) -> torch.export.ExportedProgram:
    """`torch.export.export` of `model` (in eval mode) called with `**example_inputs`; with `dynamic`, the batch and
    sequence sizes may change from call to call (`program.module()(**inputs)`)."""
    inputs = _check_inputs(model, example_inputs, dynamic)
    with torch.no_grad(), _without_cache(model):
        return torch.export.export(model, (), inputs, dynamic_shapes=dynamic_shapes(inputs) if dynamic else None)


def export_onnx(
    model: nn.Module,
    path: str | os.PathLike,
    example_inputs: Mapping[str, torch.Tensor],
    dynamic: bool = True,
    verify: bool = True,
    atol: float = 1e-4,
    overwrite: bool = False,
) -> Path:
    """Exports `model` (in eval mode) to an ONNX file with `torch.onnx.export(..., dynamo=True)`: inputs named as the
    keys of `example_inputs` (batch and sequence axes dynamic with `dynamic`), outputs named as the model's outputs
    (`last_hidden_state`, `logits`, ...). With `verify`, the file is run in onnxruntime on `example_inputs` and must
    match the eager model within `atol`. Written atomically (a failure leaves nothing at `path`); returns `path`. An
    existing file at `path` (or its `<name>.data`) is replaced only with `overwrite`."""
    path = Path(path)
    if path.suffix != ".onnx":
        raise ValueError(f"path {str(path)!r} must end in .onnx")
    for existing in (path, path.with_name(path.name + ".data")):
        if os.path.lexists(existing) and (existing.is_dir() or not overwrite):
            what = "is a folder" if existing.is_dir() else "exists: give overwrite=True to replace it"
            raise ValueError(f"path {str(existing)!r} {what}")
    if not path.parent.is_dir():
        raise ValueError(f"the folder of path {str(path)!r} does not exist")
    if not atol > 0:
        raise ValueError(f"atol={atol} must be > 0")
    inputs = _check_inputs(model, example_inputs, dynamic)
    with torch.no_grad(), _without_cache(model):
        expected = model(**inputs)
    output_names = [name for name, value in expected.items() if isinstance(value, torch.Tensor)]
    if len(output_names) != len(expected):
        raise ValueError(f"{type(model).__name__} returns outputs that are not tensors: {sorted(expected.keys())}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        with torch.no_grad(), _without_cache(model):
            torch.onnx.export(
                model,
                (),
                str(tmp / path.name),
                kwargs=inputs,
                input_names=list(inputs),
                output_names=output_names,
                dynamic_shapes=dynamic_shapes(inputs) if dynamic else None,
                dynamo=True,
                # one file, unless the weights pass protobuf's 2 GiB limit (then `<name>.data` beside it)
                external_data=sum(t.numel() * t.element_size() for t in model.state_dict().values()) >= 1.9 * 2**30,
                verbose=False,
            )
        if verify:
            actual = run_onnx(tmp / path.name, inputs)
            for name in output_names:  # onnxruntime ran on the CPU, the eager model may be on a GPU
                difference = (torch.from_numpy(actual[name]) - expected[name].cpu()).abs().max().item()
                if not difference <= atol:
                    raise RuntimeError(f"ONNX output {name!r} differs from the eager model's by {difference:.3g} > {atol}")
        for file in tmp.iterdir():  # the model, and its external data file where there is one
            os.replace(file, path.parent / file.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def run_onnx(path: str | os.PathLike, inputs: Mapping[str, torch.Tensor]) -> dict:
    """Runs an ONNX file in onnxruntime (CPU) on `inputs`; returns `{output name: numpy array}`."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected_inputs = [node.name for node in session.get_inputs()]
    missing = sorted(set(expected_inputs) - set(inputs))
    if missing:
        raise ValueError(f"{path} takes inputs {expected_inputs}; missing {missing}")
    feed = {name: inputs[name].detach().cpu().numpy() for name in expected_inputs}
    names = [node.name for node in session.get_outputs()]
    return dict(zip(names, session.run(names, feed)))


__all__ = ["dynamic_shapes", "export_onnx", "export_program", "run_onnx"]
