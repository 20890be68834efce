"""The memory values' own optimizer: their parameter group apart and a row-wise lazy Adam for them.

XLM and Kim & Jung train the memory values with their own Adam at a constant learning rate of 1e-3, without weight
decay or warm-up, and everything else (keys and query network included) with the main optimizer and schedule. A
step reads `tokens * heads * knn` rows of a table of `n_keys ** 2` rows (131,072 lookups of 262,144 rows for 8 x 128
tokens at the paper's size, ~100k distinct rows), yet dense Adam rewrites every row and keeps two fp32 moments: a
value table's training state is then 4x the table (weights, gradient, two moments). Here:

- `ProductKeyMemory(..., sparse=True)` / `set_sparse_values(model)` gives a sparse value gradient over the rows used;
- `SparseRowAdam` updates only those rows, with a bf16 first moment and a row-wise fp32 second moment (~1.5x the
  table with the weights, plus the step's sparse gradient), as large embedding-table systems do;
- `pkm_param_groups` / `pkm_value_parameters` split the parameters, `pkm_lr_lambdas` keeps the values' learning rate
  constant under a scheduler, `clip_grad_norm_` accepts the sparse gradients that torch's refuses;
- `freeze_memory` fixes a memory (Table 5), `cast_pkm_values` stores the values in bf16 for inference;
- under fp16 loss scaling with the values' own optimizer beside the main one: `unscale_once`, `step_optimizers`.

The training scripts' use of these (`--memory_optimizer`, `--memory_max_grad_norm`): `methods.optimizers.scripts`.

Typical use (two optimizers, as XLM):

    set_sparse_values(model, True)                       # before DDP wrapping; keep False for NCCL/FSDP
    main = torch.optim.AdamW(pkm_param_groups(model, lr=1e-4, weight_decay=0.01, include_values=False))
    values = SparseRowAdam(pkm_value_parameters(model), lr=1e-3)
    scheduler = transformers.get_scheduler("linear", main, num_warmup_steps=..., num_training_steps=...)
    ...
    loss.backward(); main.step(); values.step(); scheduler.step(); main.zero_grad(); values.zero_grad()
"""

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ...utils.memories import memory_modules, memory_tables, ngram_memory_modules


PKM_VALUES_GROUP = "pkm_values"


def pkm_value_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The memory tables of `model`, each once, in module order: the value tables (`values.weight`) of every
    `ProductKeyMemory` (a table shared by several memories, `pkm_shared_values`, appears once), then the hash tables
    (`tables.weight`) of every `NgramMemory`. Both are embedding tables read a few rows per token: they train in the
    memory's own group (Engram, too, trains its tables apart, with a larger learning rate than the dense weights)."""
    seen, parameters = set(), []
    for table in (table.weight for table in memory_tables(model).values()):
        if id(table) not in seen:
            seen.add(id(table))
            parameters.append(table)
    return parameters


def pkm_param_groups(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    memory_lr: float = 1e-3,
    include_values: bool = True,
) -> list[dict]:
    """Optimizer parameter groups with the memory values apart (XLM; Kim & Jung 2020).

    Returns up to three groups, each with a `"name"`:
    - `"decay"`: every other trainable parameter at `lr` with `weight_decay`;
    - `"no_decay"`: biases, scalars (the memories' learned output scale) and the parameters of LayerNorm / BatchNorm
      modules (the memories' query BatchNorm and qk-norms included) at `lr` without weight decay, as the transformers
      examples do;
    - `"pkm_values"` (when `include_values`): the value tables at the constant `memory_lr` (1e-3), no weight decay.
      Keep it out of any warm-up/decay schedule: give it its own optimizer (`include_values=False` here, and
      `SparseRowAdam(pkm_value_parameters(model), lr=memory_lr)`), or use `pkm_lr_lambdas` with one `LambdaLR`.
    Keys and query networks of the memories follow the main schedule. Empty groups are left out; frozen parameters
    (`requires_grad=False`) too.
    """
    values = {id(p) for p in pkm_value_parameters(model)}
    norms = (nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm)
    no_decay_ids = {id(p) for m in model.modules() if isinstance(m, norms) for p in m.parameters(recurse=False)}
    decay, no_decay, memory, seen = [], [], [], set()
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad or id(parameter) in seen:
            continue
        seen.add(id(parameter))
        if id(parameter) in values:
            memory.append(parameter)
        elif id(parameter) in no_decay_ids or name.endswith("bias") or parameter.ndim == 0:  # 0-d: memory scales
            no_decay.append(parameter)
        else:
            decay.append(parameter)
    groups = [
        {"params": decay, "lr": lr, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "lr": lr, "weight_decay": 0.0, "name": "no_decay"},
    ]
    if include_values:
        groups.append({"params": memory, "lr": memory_lr, "weight_decay": 0.0, "name": PKM_VALUES_GROUP})
    return [group for group in groups if group["params"]]


def pkm_lr_lambdas(
    optimizer: torch.optim.Optimizer, schedule: Callable[[int], float]
) -> list[Callable[[int], float]]:
    """Per-group multipliers for `torch.optim.lr_scheduler.LambdaLR(optimizer, pkm_lr_lambdas(optimizer, schedule))`:
    `schedule` (e.g. linear warm-up and decay) for every group except `"pkm_values"`, which stays at its lr."""
    return [(lambda step: 1.0) if group.get("name") == PKM_VALUES_GROUP else schedule for group in optimizer.param_groups]


def set_sparse_values(model: nn.Module, sparse: bool = True) -> int:
    """Switches the value gradient of every memory (and the hash tables' of every n-gram memory) to sparse (rows used by the step) or dense; returns how many
    memories were switched. Call it before wrapping the model in DDP (which reads the flag once): sparse gradients
    need a gloo process group (NCCL has no sparse all-reduce) and no FSDP; dense ones work everywhere."""
    tables = memory_tables(model)
    for table in tables.values():
        table.sparse = bool(sparse)  # as nn.Embedding(sparse=True): a sparse gradient over the rows read
    return len(tables)


def _coalesced(grad: torch.Tensor) -> torch.Tensor:
    """A coalesced view of a sparse row gradient. The autograd engine drops the `is_coalesced` flag that the memory's
    backward sets, so rows already sorted and distinct are flagged again (cheap), instead of paying `coalesce()`."""
    if grad.is_coalesced():
        return grad
    rows = grad._indices()
    if rows.shape[0] == 1 and (rows.shape[1] < 2 or bool((rows[0, 1:] > rows[0, :-1]).all())):
        return grad._coalesced_(True)
    return grad.coalesce()


def cast_pkm_values(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Stores every memory's value table in `dtype` (e.g. bf16 for inference); returns how many were cast.

    The lookup reads half the bytes in bf16 (on the 2-core CPU of benchmarks/RESULTS.md the gather of 4096 tokens
    runs ~2x faster); EmbeddingBag accumulates in fp32, but the softmax weights are rounded to bf16 and the memory
    output to bf16 before it is cast back to the hidden states' dtype (relative error ~4e-3 of the memory output).
    Meant for inference: training bf16 values has no fp32 master copy (`SparseRowAdam` then rounds each update).
    """
    count, seen = 0, set()
    for module in memory_modules(model).values():
        if id(module.values) not in seen:  # shared values: cast once
            seen.add(id(module.values))
            module.values.to(dtype)
            count += 1
    return count


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` that also takes sparse gradients (torch's raises on them): the norm of a
    sparse gradient is that of its coalesced values. Returns the total norm (before clipping); `max_norm=inf` only
    measures it."""
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    grads = [_coalesced(g) if g.is_sparse else g for g in grads]
    dense_view = [g._values() if g.is_sparse else g for g in grads]
    norms = [torch.linalg.vector_norm(g, norm_type) for g in dense_view]
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    clip_coef = None if max_norm == float("inf") else torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for parameter, grad in zip([p for p in parameters if p.grad is not None], grads):
        if grad.is_sparse:
            parameter.grad = grad  # the coalesced (and, below, scaled) gradient: not coalesced again by the optimizer
        if clip_coef is not None:
            (grad._values() if grad.is_sparse else grad).mul_(clip_coef.to(grad.device))
    return total


def _local(tensor):
    """The local shard of a DTensor (memory parallel), else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _column_shards(p: torch.Tensor):
    """(process group of the column shards or None, the table's full number of columns, the local table to write)."""
    placements = getattr(p, "placements", None)
    if placements is None:
        return None, p.shape[1], p
    from torch.distributed.tensor import Shard

    dims = [i for i, placement in enumerate(placements) if isinstance(placement, Shard)]
    if any(placements[i].dim != 1 for i in dims) or len(dims) > 1:
        raise ValueError(
            f"SparseRowAdam updates whole rows: a table sharded as {placements} is not supported (only column-wise, "
            "Shard(1), as memory parallel does; FSDP's row sharding needs dense Adam)"
        )
    group = p.device_mesh.get_group(dims[0]) if dims else None
    return group, p.shape[1], p._local_tensor


class SparseRowAdam(torch.optim.Optimizer):
    r"""Lazy, row-wise Adam for embedding-like tables such as PKM values (`(rows, dim)` parameters).

    Semantics. Only the rows present in a step's gradient are updated: the rows of a sparse gradient (coalesced if
    needed), or, for a dense gradient (DDP/NCCL, FSDP), the rows with a nonzero entry. Both give the same result except
    for a row that a step read but whose gradient is exactly zero (a memory in the last layer of a masked LM: rows read
    only by tokens without a label): the sparse form steps it with its decaying moments, the dense form cannot tell it
    from a row not read and leaves it.
    A touched row gets an Adam step with its own moments; an untouched row keeps its weights and moments unchanged
    (dense Adam would keep moving it with its decaying momentum; `torch.optim.SparseAdam` is lazy in the same way).
    The step count is per parameter (global), for the bias corrections, as in `SparseAdam`/TF `LazyAdam`.

    State (chosen for the "<= 2x the table" target; dense Adam keeps 4x: weights, gradient, two fp32 moments):
    - `exp_avg`: the first moment, per element, stored in `exp_avg_dtype` (default bf16: half the table; the update
      is computed in fp32 and rounded once per step, DeepSeek-V3 kept its AdamW moments in bf16 likewise);
    - `exp_avg_sq`: with `rowwise=True` (default) ONE fp32 second moment per row, the running mean over the row of
      the squared gradient (FBGEMM's "partial row-wise Adam"): 4 bytes a row. With `rowwise=False` the usual per-element
      fp32 second moment.
    - `betas[0] == 0`: no first moment is kept at all (as Adafactor's default): a row-wise RMSprop.
    Weights + state: 1.5x the fp32 table by default (+ 1/dim), 2x with an fp32 first moment, 3x with `rowwise=False`
    and fp32, 1x with `betas[0] == 0`; plus the step's gradient while it exists (sparse: the fraction of rows used,
    ~0.39x at 8 x 128 tokens of the paper's memory, -> 1x once a step touches every row; dense: 1x). So weights +
    gradient + state stay <= 2x the table with the defaults while a step touches <= half of the rows, and always
    with `betas[0] == 0`.

    With `rowwise=False` and `exp_avg_dtype=torch.float32`, a step in which every row has a nonzero gradient equals
    `torch.optim.Adam` (weight_decay 0) exactly, op for op. `weight_decay` is decoupled (AdamW) and, like the rest,
    applied to the touched rows only. Rows are processed in chunks of `chunk_rows` so that temporaries stay small
    (256 rows x 768 fp32 = 768 KiB, L2-sized; no fresh allocations of hundreds of MiB, which cost page faults on CPU).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        rowwise: bool = True,
        exp_avg_dtype: torch.dtype = torch.bfloat16,
        chunk_rows: int = 256,
    ):
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid betas: {betas}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid eps: {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay: {weight_decay}")
        if chunk_rows < 1:
            raise ValueError(f"Invalid chunk_rows: {chunk_rows}")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, rowwise=rowwise, exp_avg_dtype=exp_avg_dtype,
            chunk_rows=chunk_rows,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"SparseRowAdam updates rows of 2-D tables; got a parameter of shape {tuple(p.shape)}")

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            if group["betas"][0] > 0:  # beta1 = 0: no first moment at all
                state["exp_avg"] = torch.zeros_like(p, dtype=group["exp_avg_dtype"], memory_format=torch.contiguous_format)
            if group["rowwise"]:  # one per row: the same on every process of a column-sharded table
                state["exp_avg_sq"] = torch.zeros((p.shape[0],), dtype=torch.float32, device=p.device)
            else:
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype: give the first moments back their own (bf16 -> fp32 -> bf16
        # is exact), so a resumed run updates exactly as the uninterrupted one
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                if "exp_avg" in state:
                    state["exp_avg"] = state["exp_avg"].to(group["exp_avg_dtype"])

    @staticmethod
    def _touched(grad: torch.Tensor, column_group=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows, their gradient rows or None to read them from the dense gradient). `column_group`: the processes
        that hold the other columns of a column-sharded table; a row is touched where any of them sees it touched."""
        if grad.is_sparse:
            grad = _coalesced(grad)
            return grad._indices()[0], grad._values()
        touched = grad.any(dim=1)
        if column_group is not None:
            touched = touched.to(torch.int32)
            torch.distributed.all_reduce(touched, group=column_group)
            touched = touched.bool()
        return touched.nonzero().squeeze(1), None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay, rowwise = group["lr"], group["eps"], group["weight_decay"], group["rowwise"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse and p.grad.dense_dim() != 1:
                    raise ValueError("SparseRowAdam expects sparse gradients with sparse rows and dense columns")
                state = self._init_state(p, group)
                state["step"] += 1
                step = state["step"].item()
                bias_correction1 = 1 - beta1**step
                bias_correction2_sqrt = (1 - beta2**step) ** 0.5
                step_size = lr / bias_correction1
                # a table sharded column-wise (memory parallel: a DTensor placed Shard(1)): each process updates its
                # columns of the rows touched on any process; the row-wise second moment takes the whole row's mean
                column_group, columns, table = _column_shards(p)
                rows, grad_rows = self._touched(_local(p.grad), column_group)
                exp_avg, exp_avg_sq = _local(state.get("exp_avg")), _local(state["exp_avg_sq"])
                full_grad = p.grad
                for start in range(0, rows.numel(), group["chunk_rows"]):
                    index = rows[start : start + group["chunk_rows"]]
                    if grad_rows is None:
                        grad = _local(full_grad).index_select(0, index)
                    else:
                        grad = grad_rows[start : start + group["chunk_rows"]]
                    grad = grad.to(torch.float32) if grad.dtype != torch.float32 else grad
                    if exp_avg is None:
                        moment1 = grad
                    else:
                        moment1 = exp_avg.index_select(0, index)
                        moment1 = moment1.float() if moment1.dtype != torch.float32 else moment1
                        moment1.lerp_(grad, 1 - beta1)
                    moment2 = exp_avg_sq.index_select(0, index)
                    if rowwise:
                        mean_square = torch.linalg.vector_norm(grad, dim=1).square_()
                        if column_group is not None:
                            torch.distributed.all_reduce(mean_square, group=column_group)
                        mean_square.div_(columns)
                        moment2.mul_(beta2).add_(mean_square, alpha=1 - beta2)
                        denom = (moment2.sqrt() / bias_correction2_sqrt).add_(eps).unsqueeze(1)
                    else:
                        moment2.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                        denom = (moment2.sqrt() / bias_correction2_sqrt).add_(eps)
                    weights = table.index_select(0, index)
                    weights = weights.float() if weights.dtype != torch.float32 else weights
                    if weight_decay:
                        weights.mul_(1 - lr * weight_decay)
                    weights.addcdiv_(moment1, denom, value=-step_size)
                    table.index_copy_(0, index, weights.to(p.dtype))
                    if exp_avg is not None:
                        exp_avg.index_copy_(0, index, moment1.to(exp_avg.dtype))
                    exp_avg_sq.index_copy_(0, index, moment2)
        return loss


# ----------------------------------------------------------------------------------------------------------------------
# fp16 loss scaling with several optimizers (the memory values' own beside the main one). accelerate's prepared
# optimizer runs `scaler.step(optimizer)` and `scaler.update()` in each `step()`: with two optimizers the scale is
# updated twice a step, the second optimizer's record of its unscaling is reset in between (a gradient unscaled for
# clipping is unscaled again: 1/scale of its update) and its gradients are unscaled by a scale that may have grown
# (half the update). Here: each optimizer unscaled once, every optimizer stepped or none (one non-finite gradient
# skips them all), the scale updated once. Works with an injected scaler too (`accelerator.scaler`), as the tests do.


def _torch_optimizer(optimizer):
    """The torch optimizer inside accelerate's `AcceleratedOptimizer` (the object the scaler keeps records for)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _scaler_record(scaler, optimizer) -> dict:
    # torch.amp.GradScaler's per-optimizer record (stage, found_inf_per_device) since torch 1.6; it has no public
    # accessor, and `update()` reads it to decide the next scale
    return scaler._per_optimizer_states[id(optimizer)]


def unscale_once(scaler, optimizer) -> None:
    """Under loss scaling (`scaler`: `accelerator.scaler`, or the one of accelerate's prepared optimizer), divides
    `optimizer`'s gradients by the scale unless already done this step; a no-op without a scaler."""
    if scaler is None or not scaler.is_enabled():
        return
    from torch.amp.grad_scaler import OptState

    optimizer = _torch_optimizer(optimizer)
    if _scaler_record(scaler, optimizer)["stage"] is OptState.READY:
        scaler.unscale_(optimizer)


def _step_without_scaler(optimizer) -> None:
    """accelerate's wrapper stepped as without loss scaling (its own `scaler.step` and `scaler.update()` left out: the
    caller checked every optimizer's gradients and updates the scale once); its other duties (gradient accumulation,
    the schedule's record of the step) stay."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None:
        optimizer.step()
        return
    optimizer.scaler = None
    try:
        optimizer.step()
    finally:
        optimizer.scaler = scaler


def step_optimizers(accelerator, optimizers) -> bool:
    """Steps every optimizer (accelerate's wrappers: only at the end of an accumulation). Under loss scaling: each
    optimizer's gradients unscaled once, all stepped when every gradient is finite and none otherwise, then the scale
    updated once. Returns whether the step was taken (False: a skipped step; the schedule must not advance)."""
    scaler = getattr(accelerator, "scaler", None)
    if scaler is None or not scaler.is_enabled() or not accelerator.sync_gradients:
        for optimizer in optimizers:
            optimizer.step()
        return True
    for optimizer in optimizers:
        unscale_once(scaler, optimizer)
    # an optimizer without any gradient (e.g. the main one while SMF freezes all but the values) has no record and
    # nothing to step
    checks = {id(o): _scaler_record(scaler, o)["found_inf_per_device"] for o in map(_torch_optimizer, optimizers)}
    finite = not any(found.item() for record in checks.values() for found in record.values())
    if finite:
        for optimizer in optimizers:
            if checks[id(_torch_optimizer(optimizer))]:
                _step_without_scaler(optimizer)
    if any(checks.values()):
        scaler.update()  # halves the scale after a skipped step, grows it after `growth_interval` good ones
    return finite


def freeze_memory(model: torch.nn.Module) -> int:
    """Fixes every memory parameter (keys, query network, values; an n-gram memory's tables, convolution and
    projections) and the query BatchNorm's running statistics, so the
    memory is the same function after training (Table 5); returns how many parameters were frozen."""
    frozen = 0
    for memory in memory_modules(model).values():
        for batchnorm in memory.query_batchnorms():
            batchnorm.momentum = 0.0  # batch statistics still normalise in training; the running ones stay
        for parameter in memory.parameters():
            parameter.requires_grad_(False)
            frozen += parameter.numel()
    for memory in ngram_memory_modules(model).values():  # n-gram memories: no running statistics
        for parameter in memory.parameters():
            parameter.requires_grad_(False)
            frozen += parameter.numel()
    return frozen


__all__ = [
    "PKM_VALUES_GROUP",
    "SparseRowAdam",
    "cast_pkm_values",
    "clip_grad_norm_",
    "freeze_memory",
    "pkm_lr_lambdas",
    "pkm_param_groups",
    "pkm_value_parameters",
    "set_sparse_values",
    "step_optimizers",
    "unscale_once",
]
