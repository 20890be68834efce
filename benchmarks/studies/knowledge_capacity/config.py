"""The knowledge-capacity study's arms, plans and paths: what its runner (runner.py) and its report (report.py) share.
Its entry: `python benchmarks/knowledge_capacity.py` (the protocol: runner.py's docstring)."""

from pathlib import Path

from benchmarks.harness import BENCHMARKS, REPO_ROOT, results_dir


HERE = Path(__file__).resolve().parent  # the study's code and its hand-written findings (knowledge_capacity_notes.md)
ENTRY = BENCHMARKS / "knowledge_capacity.py"  # what the runs' worker processes (`--measure`) run
RESULTS = results_dir("knowledge_capacity")  # the committed runs' JSON and the report's figures
REPORT = BENCHMARKS / "KNOWLEDGE_CAPACITY.md"

RUN_MLM = REPO_ROOT / "run_scripts" / "run_mlm.py"
TOOL = "knowledge_capacity"  # its run folders hold the marker `.knowledge_capacity` (utils.output_folders)
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# the small encoder every scratch arm starts from (hidden 128, 2 layers: the scale this machine can train many times)
BASE = dict(
    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512, max_position_embeddings=128,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,  # memorisation: no dropout in any arm
)
MEMORY = dict(pkm_layers=[1], pkm_n_keys=128, pkm_heads=4, pkm_knn=32, pkm_k_dim=128)  # 16,384 slots x 128 values
ARMS = {  # name -> (config fields beyond BASE, extra run_mlm flags); "wide_*" FFN widths are set by `arm_config`
    "plain": ({}, []),
    "resm": ({**MEMORY, "pkm_mode": "resm"}, []),
    "replace": ({**MEMORY, "pkm_mode": "replace"}, []),
    "wide_params": ({}, []),  # FFN widened to resm's parameter count
    "wide_time": ({}, []),  # FFN widened to resm's measured step time
    "frozen_memory": ({**MEMORY, "pkm_mode": "resm"}, ["--freeze_memory"]),  # a fixed random memory: no storage
    "one_slot": ({**MEMORY, "pkm_mode": "resm", "pkm_n_keys": 1, "pkm_knn": 1}, []),
    "ngram": ({"ngram_layers": [1], "ngram_table_size": 4096, "ngram_dim": 32}, []),  # ~2.1M values, as resm
    # the `placement` stage, not in the plan's arms: ResM in the first layer, whose query at a name's word pieces is
    # the name itself (what the n-gram memory, read before layer 1's attention, keys on)
    "resm_layer0": ({**MEMORY, "pkm_layers": [0], "pkm_mode": "resm"}, []),
}
PLAN_ARMS = [arm for arm in ARMS if arm != "resm_layer0"]
LABELS = {
    "plain": "(a) plain",
    "resm": "(b) ResM",
    "replace": "(c) replace",
    "wide_params": "(d) FFN wide, = params",
    "wide_time": "(e) FFN wide, = step time",
    "frozen_memory": "(f) frozen random memory",
    "one_slot": "(f) one-slot memory",
    "ngram": "(g) n-gram memory",
    "resm_layer0": "(b') ResM in layer 0",
    "minilm_plain": "(h) MiniLM plain",
    "minilm_resm": "(h) MiniLM ResM",
}
FULL = dict(  # the committed run
    sizes=[25, 50, 100, 200], sweep_size=100, seeds=[0, 1, 2], learning_rates=[1e-3, 2e-3, 4e-3],
    steps=1500, batch_size=32, bios_per_person=8, memory_learning_rate=1e-2, checkpoints=4,
)
MINILM = dict(sizes=[25, 50, 100], seeds=[0, 1, 2], learning_rates=[1e-4, 2e-4, 4e-4, 1e-3], steps=300)
# arm (h): run_mlm.py converts MiniLM with these flags (+Init: ResM memories at these layers, values from zero; plain: none)
MINILM_MEMORY_LAYERS, MINILM_N_KEYS = [2, 4], 128
MINILM_ARMS = {
    "minilm_plain": ["--pkm_layers"],
    "minilm_resm": ["--pkm_layers", *map(str, MINILM_MEMORY_LAYERS), "--pkm_mode", "resm", "--pkm_value_init", "zeros",
                    "--pkm_n_keys", str(MINILM_N_KEYS)],
}
MINILM_QUICK = dict(sizes=[8], seeds=[0], learning_rates=[3e-4], steps=12)
# --masking values: facts supervised in every exposure. At 500 people, 500 steps of 32 lines (6.4 exposures a fact) and
# 1,200 (15.4) leave both arms near chance (0.02-0.04 recall, chance 0.010; the report's history): the budget is fixed
# at 3,600 steps (46 exposures), where the training loss of both arms falls steeply, measured at 4 checkpoints (the
# curve decides the goal at its last step where plain still recalls under half). One size: 1,000 people would need
# twice the steps for as many exposures, a run of ~1 hour on one core. Each rate of an arm is swept on a grid of the
# same size as plain's, one rate at a time (a 3x3 product would triple ResM's runs alone). Measuring every fact of
# 1,000 people costs ~9 minutes a model on one core (the greedy and the ranked probe, two templates), more than training
# it: every run and checkpoint is measured on the same first 250 people (1,250 facts).
MINILM_VALUES = dict(sizes=[500], sweep_size=500, seeds=[0, 1, 2], learning_rates=[3e-5, 1e-4, 3e-4],
                     memory_learning_rates=[3e-4, 1e-3, 3e-3], steps=3600, checkpoints=4, tuning="coordinate",
                     measure_people=250)
MINILM_VALUES_QUICK = dict(sizes=[8], seeds=[0], learning_rates=[1e-4, 3e-4], memory_learning_rates=[1e-3, 3e-3],
                           steps=12)
MEMORY_LR_ARMS = {"resm", "replace", "ngram", "resm_layer0", "one_slot", "minilm_resm"}  # the arms with trained values
MAX_GRID_EXTENSIONS = 3  # steps a rate's grid may grow past an edge
QUICK = dict(
    sizes=[8], sweep_size=8, seeds=[0], learning_rates=[3e-3], steps=12, batch_size=8, bios_per_person=2,
    memory_learning_rate=1e-2, checkpoints=2,
)
