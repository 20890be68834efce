"""Section `trainer`: a Trainer step with `sparse_row_adam`, PkmTrainer's sparse value gradient against the plain
Trainer's dense one."""

import tempfile

import torch

from benchmarks.harness import fmt_ms, interleaved, median, min_ratio, paired_ratio



def section_trainer(args) -> list[str]:
    """A Trainer step with `memory_optimizer="sparse_row_adam"`: PkmTrainer (sparse value gradient: the rows read) against
    the plain Trainer with `pkm_optimizers` (the same optimizer on the dense gradient of the whole table)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from modeling_pkm_bert import BertPkmConfig, BertPkmForMaskedLM
    from modeling_pkm_bert.integrations.trainer import PkmTrainer, pkm_optimizers

    rounds, batch, length = (3, 8, 128) if args.quick else (5, 8, 128)
    sizes = [(256, 256)] if args.quick else [(256, 256), (512, 256), (512, 768)]  # (n_keys, hidden = value size)
    sizes, batch = getattr(args, "trainer_sizes", None) or sizes, getattr(args, "trainer_batch", None) or batch  # tests
    generator = torch.Generator().manual_seed(0)
    scratch = tempfile.TemporaryDirectory(prefix="pkm-trainer-section-")  # the Trainer's output_dir: nothing kept
    ids = torch.randint(5, 1000, (batch, length), generator=generator)
    inputs = {"input_ids": ids, "labels": torch.where(torch.rand(batch, length, generator=generator) < 0.15, ids, -100)}
    lines = [
        "## Trainer: sparse value gradient (PkmTrainer) vs dense (plain Trainer), `sparse_row_adam`",
        "",
        f"`python benchmarks/run_benchmarks.py --sections trainer{' --quick' if args.quick else ''}`. "
        f"BertPkmForMaskedLM, 2 layers, vocab 1000, intermediate 4 x hidden, one memory (layer 1; 4 heads, knn 32, "
        f"k_dim 128, values of the hidden size); batch {batch} x {length} tokens, 15% labelled. A step is what `Trainer.train` runs per step: "
        "`training_step` (forward + backward), `_clip_grad_norm` (max_grad_norm 1.0), `optimizer.step()`, gradients "
        f"set to None. {rounds} interleaved rounds (+1 warm-up), torch threads {args.threads}. Both use the same "
        "optimizer (torch AdamW + SparseRowAdam for the values at 1e-3).",
        "",
        "| slots x hidden | value table | rows a step reads | value gradient, dense / sparse | dense step (ms) | sparse step "
        "(ms) | dense / sparse time (paired median; fastest) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n_keys, hidden in sizes:
        config = BertPkmConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=4 * hidden, max_position_embeddings=length, pkm_layers=[1], pkm_n_keys=n_keys,
                               pkm_heads=4, pkm_knn=32, pkm_k_dim=128)
        torch.manual_seed(0)
        initial = BertPkmForMaskedLM(config)
        training = TrainingArguments(scratch.name, max_steps=100, learning_rate=1e-4, report_to=[], use_cpu=True,
                                     max_grad_norm=1.0, disable_tqdm=True, save_strategy="no")
        data = Dataset.from_dict({"input_ids": ids.tolist()})
        trainers = {}
        for name in ("dense", "sparse"):
            model = BertPkmForMaskedLM(config)
            model.load_state_dict(initial.state_dict())
            if name == "sparse":
                trainer = PkmTrainer(model=model, args=training, train_dataset=data, memory_optimizer="sparse_row_adam")
                trainer.create_optimizer()
            else:
                optimizers = pkm_optimizers(model, training, memory_optimizer="sparse_row_adam")
                trainer = Trainer(model=model, args=training, train_dataset=data, optimizers=optimizers)
            trainer.current_gradient_accumulation_steps = 1  # what train() sets before its steps
            trainers[name] = trainer

        def step_fn(trainer):
            def step():
                trainer.model.train()
                trainer.training_step(trainer.model, dict(inputs))
                trainer._clip_grad_norm(trainer.model)
                trainer.optimizer.step()
                trainer.model.zero_grad(set_to_none=True)

            return step

        samples = interleaved({name: step_fn(t) for name, t in trainers.items()}, rounds=rounds, warmup=1)
        sparse = trainers["sparse"].model
        sparse.train()
        trainers["sparse"].training_step(sparse, dict(inputs))
        gradient = sparse.bert.encoder.layer[1].memory.values.weight.grad.coalesce()
        rows_read = gradient._nnz() / n_keys**2
        sparse_mib = (gradient._values().nbytes + gradient._indices().nbytes) / 2**20
        sparse.zero_grad(set_to_none=True)
        table_mb = n_keys**2 * hidden * 4 / 2**20
        lines.append(
            f"| {n_keys}^2 x {hidden} | {table_mb:.3g} MiB fp32 | {rows_read:.0%} | {table_mb:.3g} / {sparse_mib:.3g} MiB | "
            f"{fmt_ms(median(samples['dense']))} | "
            f"{fmt_ms(median(samples['sparse']))} | {paired_ratio(samples, 'dense', 'sparse'):.2f}; "
            f"{min_ratio(samples, 'dense', 'sparse'):.2f} |"
        )
        del trainers, samples, initial
    return lines
