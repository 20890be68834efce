"""Memory parallel: the value tables of the product key memories sharded column-wise across processes.

Every process keeps all `n_keys ** 2` rows of each value table but only `v_dim / world` of its columns (Memory Layers
at Scale, Berges et al. 2024). The rest of the model is data parallel (FSDP2's `fully_shard`, or DDP), so each process
has its own tokens: a lookup gathers the slot indices and score weights of every process's tokens, each process sums
its column slice of the selected rows for all of them, and one all-to-all returns to every process the full `v_dim`
output of its own tokens. Backward runs the same exchanges reversed (an all-to-all of the output gradient; the score
weights' gradient summed over the column owners by a second all-to-all), and each process's column gradient is the
batch mean over all processes, the average FSDP/DDP apply to the other parameters.

One code path for CPU/gloo and GPU/NCCL: `torch.distributed` all_gather and all_to_all_single with equal splits (the
token lists are padded to the longest), the table a DTensor with placement `Shard(1)` on the mesh, so that
`torch.distributed.checkpoint` saves and reshards it and `full_tensor()` consolidates it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..product_key_memory import ProductKeyMemory
from ..utils.memories import ngram_memory_modules


def _memories(model: nn.Module) -> list[tuple[str, ProductKeyMemory]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, ProductKeyMemory)]


def _mesh_group(device_mesh, mesh_dim):
    if device_mesh.ndim == 1:
        return device_mesh, device_mesh.get_group()
    # a table sharded over one dimension and replicated over another would need its column gradients all-reduced over
    # the replicas, which nothing does yet: refused rather than silently unsynchronised
    raise ValueError(
        f"memory parallel on a {device_mesh.ndim}-D device mesh {device_mesh.mesh_dim_names} (mesh_dim={mesh_dim!r}) is "
        "not supported yet (the replicas' column gradients would not be averaged): pass a 1-D mesh over all processes"
    )


class _GatherTokens(torch.autograd.Function):
    """`(max_tokens, k)` per process -> `(world * max_tokens, k)`, every process's rows in rank order. Backward: each
    process's gradient rows summed over all processes (a reduce-scatter through all_to_all_single)."""

    @staticmethod
    def forward(ctx, rows, group, world):
        ctx.group, ctx.world = group, world
        gathered = [torch.empty_like(rows) for _ in range(world)]
        dist.all_gather(gathered, rows.contiguous(), group=group)
        return torch.cat(gathered)

    @staticmethod
    def backward(ctx, grad):
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad.contiguous(), group=ctx.group)
        parts = received.chunk(ctx.world)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total, None, None


class _ExchangeColumns(torch.autograd.Function):
    """`(world * max_tokens, v_dim / world)` (this process's columns for every process's tokens) -> `(max_tokens,
    v_dim)` (all columns for this process's tokens), by one all_to_all_single; backward the reverse exchange."""

    @staticmethod
    def forward(ctx, local, group, world):
        ctx.group, ctx.world = group, world
        received = torch.empty_like(local)
        dist.all_to_all_single(received, local.contiguous(), group=group)
        tokens, columns = received.shape[0] // world, received.shape[1]
        return received.view(world, tokens, columns).transpose(0, 1).reshape(tokens, world * columns)

    @staticmethod
    def backward(ctx, grad):
        world = ctx.world
        tokens = grad.shape[0]
        send = grad.reshape(tokens, world, -1).transpose(0, 1).reshape(world * tokens, -1).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=ctx.group)
        return received, None, None


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, scale):
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class ShardedProductKeyValues(nn.Module):
    r"""
    A [`ProductKeyValues`] table sharded column-wise over one dimension of a device mesh: `weight` is a DTensor of
    global shape `(num_slots, v_dim)` with placement `Shard(1)`; each process stores `(num_slots, v_dim / world)`.
    Called as the table it replaces (`values(indices, per_sample_weights=weights)`, sum of the weighted rows), on
    each process's own tokens; every process of the mesh must call it the same number of times (it communicates).

    `average_gradients=True` (default, for data parallel training): the column gradient is the mean over the
    processes' batches, as FSDP and DDP average the other gradients; `False`: their sum.
    """

    mode = "sum"
    sparse = False  # sparse gradients are refused under memory parallel (see shard_memory_values)

    def __init__(self, values: nn.EmbeddingBag, device_mesh, mesh_dim: str | None = None, average_gradients=True):
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh, group = _mesh_group(device_mesh, mesh_dim)
        world = mesh.size()
        num_slots, v_dim = values.weight.shape
        if v_dim % world:
            raise ValueError(
                f"memory parallel: v_dim={v_dim} (the value table's embedding dimension) is not divisible by the "
                f"{world} processes of the mesh dimension it is sharded over; choose a v_dim (hidden_size) that is a "
                f"multiple of {world}, or a mesh dimension whose size divides {v_dim}"
            )
        self.num_embeddings, self.embedding_dim = num_slots, v_dim
        self.device_mesh, self.group, self.world = mesh, group, world
        self.average_gradients = average_gradients
        weight = values.weight.detach()
        if weight.device.type != mesh.device_type:
            weight = weight.to(mesh.device_type if mesh.device_type != "cuda" else torch.device("cuda", torch.cuda.current_device()))
        self.weight = nn.Parameter(
            distribute_tensor(weight, mesh, [Shard(1)]), requires_grad=values.weight.requires_grad
        )

    def forward(self, input, offsets=None, per_sample_weights=None):
        if offsets is not None or input.dim() != 2:
            raise ValueError("ShardedProductKeyValues takes 2-d indices (tokens, slots per token) without offsets")
        if per_sample_weights is None:
            per_sample_weights = torch.ones(input.shape, dtype=self.weight.dtype, device=input.device)
        tokens = input.shape[0]
        counts = [torch.zeros(1, dtype=torch.long, device=input.device) for _ in range(self.world)]
        dist.all_gather(counts, torch.tensor([tokens], device=input.device), group=self.group)
        longest = int(torch.cat(counts).max())
        pad = longest - tokens
        if pad:
            input = F.pad(input, (0, 0, 0, pad))  # slot 0 with weight 0: a zero row, no gradient
            per_sample_weights = F.pad(per_sample_weights, (0, 0, 0, pad))
        all_indices = torch.empty((self.world * longest, input.shape[1]), dtype=input.dtype, device=input.device)
        dist.all_gather(list(all_indices.chunk(self.world)), input.contiguous(), group=self.group)
        all_weights = _GatherTokens.apply(per_sample_weights, self.group, self.world)
        local = self.weight.to_local()
        if self.average_gradients and self.world > 1:
            local = _ScaleGradient.apply(local, 1.0 / self.world)
        columns = F.embedding_bag(all_indices, local, per_sample_weights=all_weights, mode="sum")
        return _ExchangeColumns.apply(columns, self.group, self.world)[:tokens]

    def release_workspace(self):
        """Nothing to release (the interface of ProductKeyValues)."""

    def full_weight(self) -> torch.Tensor:
        """The whole table `(num_slots, v_dim)` (a collective: every process of the mesh calls it)."""
        return self.weight.full_tensor()

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, mode='sum', sharded over {self.world} processes "
            f"({self.embedding_dim // self.world} columns each)"
        )


def shard_memory_values(
    model: nn.Module, device_mesh, mesh_dim: str | None = None, average_gradients: bool = True
) -> list[ShardedProductKeyValues]:
    r"""
    Memory parallel: replaces the value table of every `ProductKeyMemory` in `model` (in place) by a
    [`ShardedProductKeyValues`] that keeps on each process all rows but `v_dim / world` columns of it, `world` being the
    size of the 1-D `device_mesh` (a 2-D mesh, `mesh_dim`, is refused for now: ValueError). Call it on every process, on identical models (the
    table is taken from rank 0 of the mesh), before `fully_shard` / the optimizer; pass the returned tables' weights
    to `fully_shard(..., ignored_params=...)` ([`fully_shard_with_memory_parallel`] does both).

    A table shared by several memories (`pkm_shared_values`) is sharded once and stays one module in all of them.
    Refused with a ValueError naming the setting: a `v_dim` the mesh does not divide, sparse value gradients
    (`sparse=True`, e.g. for SparseRowAdam: memory parallel keeps the gradients dense), a shared table whose memories
    disagree on its shape, a model with hashed n-gram memories (not sharded). Returns the sharded tables, each once.
    """
    ngram = ngram_memory_modules(model)
    if ngram:
        # their tables are read row-wise by hashed ids, with no column-sharded lookup written for them (yet)
        raise ValueError(
            f"shard_memory_values: the model has hashed n-gram memories ({', '.join(ngram)}), whose tables memory "
            "parallel does not shard; train it with plain DDP, or without ngram_layers"
        )
    memories = _memories(model)
    if not memories:
        raise ValueError("shard_memory_values: the model has no ProductKeyMemory")
    world = _mesh_group(device_mesh, mesh_dim)[0].size()
    for name, memory in memories:  # every check before any table is replaced: a refused model stays as it was
        values = memory.values
        if isinstance(values, ShardedProductKeyValues):
            continue
        if getattr(values, "sparse", False):
            raise ValueError(
                f"{name}.values has sparse=True (sparse value gradients, e.g. --memory_optimizer sparse_row_adam "
                "switches them on): memory parallel and FSDP need dense gradients; set sparse_values = False on the "
                "memories (SparseRowAdam then updates the rows whose dense gradient is non-zero)"
            )
        if tuple(values.weight.shape) != (memory.mem_size, memory.v_dim):
            raise ValueError(
                f"{name}.values: a table of shape {tuple(values.weight.shape)} in a memory of n_keys ** 2 = "
                f"{memory.mem_size} slots and v_dim={memory.v_dim}: the shared table's shards would not match"
            )
        if values.weight.shape[1] % world:
            raise ValueError(
                f"memory parallel: {name} has v_dim={values.weight.shape[1]} (the value table's embedding dimension), "
                f"not divisible by the {world} processes of the mesh dimension it is sharded over; choose a v_dim "
                f"(hidden_size) that is a multiple of {world}, or a mesh dimension whose size divides it"
            )
    replaced: dict[int, ShardedProductKeyValues] = {}
    for name, memory in memories:
        values = memory.values
        if isinstance(values, ShardedProductKeyValues):
            replaced.setdefault(id(values), values)
            continue
        if id(values) not in replaced:
            replaced[id(values)] = ShardedProductKeyValues(values, device_mesh, mesh_dim, average_gradients)
        memory.values = replaced[id(values)]
    return list(dict.fromkeys(replaced.values()))


def memory_parallel_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The sharded value tables' weights of `model` (for `fully_shard(..., ignored_params=...)`)."""
    return {m.weight for m in model.modules() if isinstance(m, ShardedProductKeyValues)}


def fully_shard_with_memory_parallel(model: nn.Module, device_mesh, memory_parallel: bool = True, **fsdp_kwargs):
    """FSDP2 on `model`: `fully_shard` on each BERT layer and on the whole model, the value tables first sharded
    column-wise by [`shard_memory_values`] (with `memory_parallel=False`, FSDP2 shards them too, row-wise, as any
    parameter). Returns the model (now an FSDPModule)."""
    from .arguments import fsdp2_torch_problem

    problem = fsdp2_torch_problem(torch.__version__)
    if problem:
        raise ImportError(problem)
    from torch.distributed.fsdp import fully_shard

    ignored = set()
    if memory_parallel:
        shard_memory_values(model, device_mesh)
        ignored = memory_parallel_parameters(model)
    else:
        for name, memory in _memories(model):
            if getattr(memory.values, "sparse", False):
                raise ValueError(
                    f"{name}.values has sparse=True (sparse value gradients): FSDP2 refuses sparse gradients; keep the "
                    "value gradients dense (sparse_values = False) under FSDP"
                )
    # a table shared by several layers (pkm_shared_values, not memory parallel) belongs to the whole model's unit
    tables = [memory.values.weight for _, memory in _memories(model)]
    shared = {weight for weight in tables if sum(w is weight for w in tables) > 1} - ignored
    for module in model.modules():
        if type(module).__name__ == "BertPkmLayer":
            fully_shard(module, mesh=device_mesh, ignored_params=(ignored | shared) or None, **fsdp_kwargs)
    fully_shard(model, mesh=device_mesh, ignored_params=ignored or None, **fsdp_kwargs)
    check_batch_statistics_everywhere(model, device_mesh.get_group())
    # as DDP (broadcast_buffers): the buffers (the query BatchNorms' running statistics, which each process updates
    # from its own tokens) are rank 0's at the start of every training forward, so checkpoints and the saved model
    # hold one consistent set
    model.register_forward_pre_hook(lambda module, args: sync_buffers(module, device_mesh) if module.training else None)
    return model


def check_batch_statistics_everywhere(model: nn.Module, group=None):
    """Before each training forward of `model` (a forward pre-hook, run before any other), every process learns how
    many real tokens each process's batch has, and all raise the same ValueError when one has fewer than the 2 its
    query BatchNorms need for batch statistics. Without it the memory of that process alone would raise, while the
    others wait for it in a collective (a memory-parallel exchange, an FSDP2 all-gather, DDP's gradient all-reduce).
    One all_gather of one number per training forward; nothing when no memory has a query BatchNorm."""
    memories = [memory for _, memory in _memories(model) if memory.query_batchnorms()]
    if not memories:
        return None

    def check(module, args, kwargs):
        if any(memory.training for memory in memories):
            real_tokens = _real_tokens(args, kwargs)
            if real_tokens is not None:
                _refuse_too_few_real_tokens(real_tokens, group)

    return model.register_forward_pre_hook(check, with_kwargs=True, prepend=True)


def _real_tokens(args, kwargs) -> torch.Tensor | None:
    """The number of tokens the memories look up in a BertPkm forward `(1,)`: the padding mask's ones at the current
    positions, else every position (a 4-D attention mask: the memory's own check decides); None without inputs."""
    input_ids, embeddings = kwargs.get("input_ids", args[0] if args else None), kwargs.get("inputs_embeds")
    if input_ids is None and embeddings is None:
        return None
    positions = input_ids.shape if input_ids is not None else embeddings.shape[:-1]
    device = (input_ids if input_ids is not None else embeddings).device
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if mask is not None and mask.shape[:-1] == positions[:-1]:  # (..., past + current positions)
        return mask[..., -positions[-1] :].count_nonzero().reshape(1)
    return torch.tensor([positions.numel()], device=device)


def _refuse_too_few_real_tokens(real_tokens: torch.Tensor, group) -> None:
    world = dist.get_world_size(group)
    counts = [torch.empty_like(real_tokens) for _ in range(world)]
    dist.all_gather(counts, real_tokens, group=group)
    few = [(rank, int(count)) for rank, count in enumerate(counts) if count < 2]
    if few:
        described = ", ".join(f"process {rank}: {count}" for rank, count in few)
        raise ValueError(
            f"real tokens (attention_mask == 1) in this training step's batch of {described}: the query BatchNorm of "
            "each memory takes batch statistics of each process's own tokens and needs at least 2 on every process; "
            "use larger batches (--per_device_train_batch_size) or sequences with more real tokens"
        )


@torch.no_grad()
def sync_buffers(model: nn.Module, device_mesh) -> None:
    """Broadcasts the floating-point and integer buffers of `model` from the mesh's first process (a collective)."""
    from torch.distributed.tensor import DTensor

    group = device_mesh.get_group() if device_mesh.ndim == 1 else None
    if dist.get_world_size(group) == 1:
        return
    source = dist.get_global_rank(group, 0) if group is not None else 0
    for buffer in model.buffers():
        if not isinstance(buffer, DTensor):
            dist.broadcast(buffer, src=source, group=group)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict as plain CPU tensors (DTensors of FSDP2 and of memory parallel gathered; a table
    that several names hold, `pkm_shared_values` or tied embeddings, stays one tensor, so `save_pretrained` stores it
    once). A collective: call it on every process."""
    from torch.distributed.tensor import DTensor

    state, gathered = {}, {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in gathered:
            tensor = value.full_tensor() if isinstance(value, DTensor) else value
            gathered[id(value)] = tensor.detach().cpu()
        state[key] = gathered[id(value)]
    return state


def save_consolidated(model: nn.Module, save_directory, is_main_process: bool, **kwargs) -> None:
    """Saves a sharded (FSDP2 / memory parallel) BertPkm model as a normal Hub folder: safetensors of the whole
    tables and the remote code, loadable by one process without this package. Call it on every process (it gathers);
    the main process writes. `kwargs` go to `save_pretrained`."""
    state = full_state_dict(model)
    if is_main_process:
        # fully_shard swaps the model's class for a subclass FSDP<class>: the folder records (and copies the code
        # of) the model's own class, so save under it
        sharded_class = type(model)
        model.__class__ = next(c for c in sharded_class.__mro__ if not c.__name__.startswith("FSDP"))
        try:
            model.save_pretrained(save_directory, state_dict=state, **kwargs)
        finally:
            model.__class__ = sharded_class


def value_bytes_per_process(model: nn.Module) -> int:
    """The bytes of value tables this process stores (each table once; local shards of sharded ones)."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for _, memory in _memories(model):
        weight = memory.values.weight
        if id(weight) in seen:
            continue
        seen.add(id(weight))
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        total += local.numel() * local.element_size()
    return total
