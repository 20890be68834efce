"""Loads the folders of `write_folders.py` through remote code in a process that cannot import modeling_pkm_bert, and
checks every output against `expected.json`; generation, the fill-mask pipeline and a training step must work:
`python check_folders.py FOLDERS_DIR`. Prints one JSON line with what it checked."""

import json
import sys
from pathlib import Path


sys.modules["modeling_pkm_bert"] = None  # only the folders' own code can run here
try:
    import modeling_pkm_bert  # noqa: F401

    raise SystemExit("modeling_pkm_bert must not be importable here")
except ImportError:
    pass

import torch  # noqa: E402
import transformers  # noqa: E402
from inputs import fixed_inputs, forward_kwargs  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402


AUTO_CLASSES = {
    "BertPkmModel": "AutoModel",
    "BertPkmForMaskedLM": "AutoModelForMaskedLM",
    "BertPkmForSequenceClassification": "AutoModelForSequenceClassification",
    "BertPkmForQuestionAnswering": "AutoModelForQuestionAnswering",
    "BertPkmForTokenClassification": "AutoModelForTokenClassification",
    "BertPkmForMultipleChoice": "AutoModelForMultipleChoice",
    "BertPkmForCausalLM": "AutoModelForCausalLM",
}
AUTO_CLASSES.update(
    {name.replace("BertPkm", family): auto for name, auto in AUTO_CLASSES.items() for family in ("RobertaPkm", "ModernBertPkm")}
)


def main(folders_dir: str):
    root = Path(folders_dir)
    expected = json.loads((root / "expected.json").read_text())
    report = {"transformers": transformers.__version__, "written_with": expected["transformers"], "checked": []}
    for name, record in expected["folders"].items():
        auto_class = getattr(transformers, AUTO_CLASSES[record["class"]])
        model = auto_class.from_pretrained(root / name, trust_remote_code=True).eval()
        assert type(model).__name__ == record["class"] and type(model).__module__.startswith("transformers_modules")
        inputs = fixed_inputs(name, model.config.vocab_size)
        with torch.no_grad():
            outputs = model(**inputs, **forward_kwargs(name))
        torch.testing.assert_close(outputs[0], torch.tensor(record["outputs"]), atol=1e-5, rtol=1e-5, msg=name)
        if "generated" in record:
            prompt = inputs["input_ids"][:1, :4]
            generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
            assert generated.tolist() == record["generated"], (name, generated.tolist(), record["generated"])
        report["checked"].append(name)

    # the fill-mask pipeline on the masked LM (of each family the folders hold)
    for name in ("mlm", "modernbert_mlm"):
        if name not in expected["folders"]:
            continue
        tokenizer = AutoTokenizer.from_pretrained(root / name, trust_remote_code=True)
        fill = transformers.pipeline("fill-mask", model=str(root / name), tokenizer=tokenizer, trust_remote_code=True)
        answers = fill("the cat [MASK] on the mat")
        assert len(answers) == 5 and all(answer["token_str"] for answer in answers)
        report["checked"].append("fill-mask" if name == "mlm" else f"fill-mask:{name}")

    # a few training steps of each kind of head: every memory parameter gets a finite gradient, the loss goes down
    trained = [("mlm_memory_plus", "tokens"), ("cls", "classes"), ("causal", "tokens"), ("causal_memory_plus", "tokens"),
               ("causal_ngram", "tokens"), ("modernbert_mlm", "tokens"), ("modernbert_cls_memory_plus", "classes")]
    for name, labels in [(name, labels) for name, labels in trained if name in expected["folders"]]:
        model = getattr(transformers, AUTO_CLASSES[expected["folders"][name]["class"]]).from_pretrained(
            root / name, trust_remote_code=True
        )
        model.train()
        inputs = fixed_inputs(name, model.config.vocab_size)
        inputs["labels"] = inputs["input_ids"] if labels == "tokens" else torch.tensor([0, 2])
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            loss = model(**inputs).loss
            loss.backward()
            memory_grads = [p.grad for n, p in model.named_parameters() if ".memory." in n and p.requires_grad]
            assert memory_grads and all(g is not None and torch.isfinite(g).all() for g in memory_grads), name
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0], (name, losses)
        report["checked"].append(f"train:{name}")
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
