"""Uneven data on 2 CPU processes (gloo) under DDP, `--fsdp2` and `--memory_parallel`: no collective can hang.

Under FSDP2 every layer's forward, and under memory parallel every memory lookup, is a collective that all processes
must enter. The evaluations of run_glue.py (`evaluate`, `measure_memory_usage`) and run_mlm.py (`evaluate`, through
`training.lm_data.evaluate_language_model`) run here on 9, 7 and 1 examples (shards of unequal numbers of batches) and
on a batch that is all padding on one process; each example must count exactly once (the one-process predictions,
loss and memory-usage counts). A training forward with fewer than 2 real tokens on one process (the query BatchNorm's
batch statistics) must fail on every process with one clear error; without a query BatchNorm, a padding-only training
batch on one process trains.

One launch of 2 processes runs every case (start-up dominates on 2 cores) and writes one JSON line per case and process
as it finishes; the launch is killed after DEADLINE seconds, so a hang fails the cases it did not finish.
"""

import argparse
import json
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from helpers import BertPkmModelTester, load_script


pytestmark = pytest.mark.multiprocess  # every test reads the records of one launch of 2 processes

WORLD = 2
DEADLINE = 240  # seconds for the whole launch (about 40 s when nothing hangs, on 2 shared cores)
MODES = ("ddp", "fsdp2", "memory_parallel")
# name: (examples, evaluation batch size, the examples that are all padding)
CASES = {
    "9_examples": (9, 4, ()),  # shards of 5 and 4 examples: 2 batches on process 0, 1 on process 1
    "7_examples": (7, 3, ()),  # shards of 4 and 3: 2 batches and 1
    "1_example": (1, 4, ()),  # process 1 has no example at all
    "padding_batch": (6, 2, (3, 4)),  # process 1's first batch (examples 3 and 4) has no real token
}
# process 0's training batch (process 1's is normal): its real tokens, whether the memory has a query BatchNorm
TRAINING_CASES = {
    "train_1_real_token": (1, True),  # refused: no batch statistics of 1 token
    "train_no_real_token": (0, True),  # refused: none of 0 tokens
    "train_no_real_token_without_batchnorm": (0, False),  # trains: zero gradients from process 0's memory
}


def examples(count: int, padded=(), vocab_size=99) -> list[dict]:
    """Sequences of 3 to 8 tokens; `padded` ones have no real token. Labels: a class (GLUE) and a token label at
    positions 1 and 2 (masked LM; -100 elsewhere and on padding)."""
    generator = torch.Generator().manual_seed(count)
    rows = []
    for i in range(count):
        length = 3 + (5 * i) % 6
        input_ids = torch.randint(5, vocab_size, (length,), generator=generator).tolist()
        real = 0 if i in padded else 1
        token_labels = [token if real and position in (1, 2) else -100 for position, token in enumerate(input_ids)]
        rows.append({"input_ids": input_ids, "attention_mask": [real] * length, "label": i % 2, "token_labels": token_labels})
    return rows


def collate(kind):
    """Pads a list of examples into a batch (0 / attention 0 / label -100) for `kind` "glue" or "mlm"."""

    def collate_fn(rows):
        longest = max(len(row["input_ids"]) for row in rows)

        def padded(key, value):
            return torch.tensor([row[key] + [value] * (longest - len(row[key])) for row in rows])

        batch = {"input_ids": padded("input_ids", 0), "attention_mask": padded("attention_mask", 0)}
        if kind == "glue":
            batch["labels"] = torch.tensor([row["label"] for row in rows])
        else:
            batch["labels"] = padded("token_labels", -100)
        return batch

    return collate_fn


def make_model(kind, batchnorm=True):
    from modeling_pkm_bert import BertPkmForMaskedLM, BertPkmForSequenceClassification

    if kind == "glue":
        return BertPkmModelTester().get_model(BertPkmForSequenceClassification, seed=0, num_labels=2).eval()
    return BertPkmModelTester().get_model(BertPkmForMaskedLM, seed=0, pkm_query_batchnorm=batchnorm).eval()


def prepare(accelerator, model, mode):
    """As the scripts do (training.preparation): shard with --fsdp2 / --memory_parallel, else DDP by accelerate."""
    from modeling_pkm_bert.parallel import prepare_memory_parallel

    args = argparse.Namespace(fsdp2=mode == "fsdp2", memory_parallel=mode == "memory_parallel", memory_optimizer="adam")
    model = prepare_memory_parallel(accelerator, model, args)
    return accelerator.prepare(model) if mode == "ddp" else model


@torch.no_grad()
def reference(kind, rows):
    """One process, every example in one batch: (GLUE predictions and memory tokens per class, or the masked-LM loss;
    memory tokens)."""
    from modeling_pkm_bert.analysis.class_usage import PerClassMemoryUsage
    from modeling_pkm_bert.analysis.memory_usage import track_memory_usage

    model = make_model(kind)
    batch = collate(kind)(rows)
    class_usage = PerClassMemoryUsage(model, 2).attach() if kind == "glue" else None
    with track_memory_usage(model) as tracker:
        if class_usage is not None:
            class_usage.set_batch(batch["labels"], batch["attention_mask"])
        output = model(**batch)
    result = {"tokens": {layer: usage["tokens"] for layer, usage in tracker.results().items()}}
    if kind == "glue":
        result["predictions"] = output.logits.argmax(-1).tolist()
        result["class_tokens"] = {
            layer: [int(accumulator.tokens) for accumulator in accumulators]
            for layer, accumulators in class_usage.accumulators.items()
        }
    else:
        result["loss"] = float(output.loss)
    return result


def evaluate(kind, accelerator, model, rows, batch_size, scripts):
    """The script's own evaluation of `rows` (the shape of `reference`)."""
    import datasets

    dataset = datasets.Dataset.from_list(rows)
    args = argparse.Namespace(per_device_eval_batch_size=batch_size, trime_eval=None)
    if kind == "glue":
        run_glue = scripts["run_glue"]
        seen = {}

        def run(class_usage):
            seen["class_usage"] = class_usage
            return run_glue.evaluate(
                args, accelerator, model, dataset.remove_columns("token_labels"), collate(kind),
                lambda predictions, references: {"predictions": predictions, "references": references},
                is_regression=False, class_usage=class_usage,
            )  # fmt: skip

        metrics, usage, _ = run_glue.measure_memory_usage(accelerator, model, ["a", "b"], run)
        assert metrics["references"] == [row["label"] for row in rows], metrics["references"]
        return {
            "predictions": metrics["predictions"],
            "tokens": {layer: values["tokens"] for layer, values in usage.items()},
            "class_tokens": {
                layer: [int(accumulator.tokens) for accumulator in accumulators]
                for layer, accumulators in seen["class_usage"].accumulators.items()
            },
        }
    metrics, usage = scripts["run_mlm"].evaluate(args, accelerator, model, {"set": dataset}, collate(kind), True)
    return {"loss": metrics["eval_set_loss"], "tokens": {layer: values["tokens"] for layer, values in usage.items()}}


def train_forward(accelerator, model, real_tokens: int):
    """One training forward and backward; process 0's batch has `real_tokens` real tokens."""
    model.train()
    input_ids = torch.randint(5, 99, (2, 6), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    if accelerator.process_index == 0:
        attention_mask.zero_()
        attention_mask[0, :real_tokens] = 1
    model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss.backward()


def _worker(rank, port, out_dir):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD)
    )
    os.environ.update(ACCELERATE_USE_CPU="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == WORLD, accelerator.state
    scripts = {name: load_script(name) for name in ("run_glue", "run_mlm")}
    with open(os.path.join(out_dir, f"rank{rank}.jsonl"), "a") as log:

        def record(name, **result):
            log.write(json.dumps({"case": name, **result}) + "\n")
            log.flush()

        for mode in MODES:
            for kind in ("glue", "mlm"):
                model = prepare(accelerator, make_model(kind), mode)
                for case, (count, batch_size, padded) in CASES.items():
                    rows = examples(count, padded)
                    try:
                        result = evaluate(kind, accelerator, model, rows, batch_size, scripts)
                    except Exception as error:  # noqa: BLE001 (recorded; the test names it)
                        record(f"{mode}-{kind}-{case}", error=f"{type(error).__name__}: {error}")
                        continue
                    record(f"{mode}-{kind}-{case}", result=result, expected=reference(kind, rows))
            for case, (real_tokens, batchnorm) in TRAINING_CASES.items():
                model = prepare(accelerator, make_model("mlm", batchnorm), mode)
                try:
                    train_forward(accelerator, model, real_tokens)
                    record(f"{mode}-{case}", error=None)
                except Exception as error:  # noqa: BLE001 (recorded; the test names it)
                    record(f"{mode}-{case}", error=f"{type(error).__name__}: {error}")
    accelerator.end_training()
    torch.distributed.destroy_process_group()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """{case: [record of process 0, record of process 1]} of one launch; a case missing: it hung (or the launch died
    before it)."""
    out_dir = tmp_path_factory.mktemp("uneven")
    context = mp.start_processes(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=False, start_method="spawn")
    deadline, crash = time.monotonic() + DEADLINE, None
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                break
    except Exception as error:  # noqa: BLE001 (a process died: the cases it finished still count)
        crash = error
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    per_case = {}
    for rank in range(WORLD):
        path = out_dir / f"rank{rank}.jsonl"
        for line in path.read_text().splitlines() if path.is_file() else []:
            record = json.loads(line)
            per_case.setdefault(record["case"], [None] * WORLD)[rank] = record
    return per_case, crash


def _both(records, case):
    per_case, crash = records
    found = per_case.get(case, [None] * WORLD)
    missing = [rank for rank, record in enumerate(found) if record is None]
    why = f"the launch died before: {crash}" if crash else f"not within {DEADLINE} s: a hang"
    assert not missing, f"{case}: no result from process(es) {missing} ({why})"
    return found


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["glue", "mlm"])
@pytest.mark.parametrize("mode", MODES)
def test_evaluation_counts_every_example_once(records, mode, kind, case):
    """Every process ends with the one-process predictions (GLUE) or masked-LM loss, and the memory-usage token counts
    (per class for GLUE) of every real token once."""
    for record in _both(records, f"{mode}-{kind}-{case}"):
        assert "error" not in record, record["error"]
        result, expected = record["result"], record["expected"]
        assert result["tokens"] == expected["tokens"]
        if kind == "glue":
            assert result["predictions"] == expected["predictions"]
            assert result["class_tokens"] == expected["class_tokens"]
        else:
            assert result["loss"] == pytest.approx(expected["loss"], rel=1e-5)


@pytest.mark.parametrize("case", list(TRAINING_CASES))
@pytest.mark.parametrize("mode", MODES)
def test_training_batch_with_too_few_real_tokens_on_one_process(records, mode, case):
    """Process 0's training batch has 1 real token, or none: a query BatchNorm cannot take batch statistics of it, and
    every process raises the same ValueError naming process 0 (none hangs in a collective the failing one never
    enters). Without a query BatchNorm a batch of padding trains: the memory reads its 0 tokens, so its parameters get
    (zero) gradients on that process too, which DDP and FSDP2 wait for."""
    errors = [record["error"] for record in _both(records, f"{mode}-{case}")]
    if not TRAINING_CASES[case][1]:
        assert errors == [None, None]
        return
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert errors[0].startswith("ValueError") and "process 0" in errors[0] and "real token" in errors[0]
