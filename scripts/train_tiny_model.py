"""Make the tiny pretrained math model shipped in ``src/strop/assets/tiny-math``.

    .venv/bin/python scripts/train_tiny_model.py            # what made the shipped weights

Steps, all seeded by ``--seed``:

1. synthetic GSM8K-style splits (``strop.data.synthetic.write_splits``);
2. a byte-level BPE tokenizer trained on the train split (digits one per token, as in
   Qwen2), with the ChatML chat template, ``<|im_end|>`` as EOS and ``<|endoftext|>`` as pad;
3. a random-init Qwen2 built with ``transformers`` and saved as a HF directory;
4. full fine-tuning with strop's own SFT, recipe ``sft-tiny-math`` (``strop sft``);
5. greedy accuracy on the validation split with strop's evaluation (``strop eval``);
6. the exported weights, tokenizer and a model card written into the asset directory.

The model should be clearly imperfect so that PPO has room to improve it, and the way it
is imperfect is chosen: 70% of its SFT demonstrations answer too early (every step worked
out, then the first step's result after ``####``), so the model learns that shortcut and
gets many multi-step problems wrong it has actually solved. A verifiable reward can
unlearn exactly that; plain SFT on the same demonstrations cannot. Extra ``key=value`` arguments override the
recipe (``sft.steps=300``). On a CPU shared with other jobs, ``OMP_NUM_THREADS=1`` keeps
torch from oversubscribing the cores (which can make steps ten times slower).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSET_DIR = ROOT / "src" / "strop" / "assets" / "tiny-math"
RECIPE = "sft-tiny-math"
ASSET_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# Model size: about 0.9M parameters, 3.6 MB of float32 weights.
MODEL = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
VOCAB_SIZE = 384
N_TRAIN = 20000
N_VALIDATION = 256
MAX_STEPS = 3  # arithmetic steps per problem
# Flawed demonstrations: this fraction of the SFT solutions work out every step but give the
# first step's result after "####" (strop.data.synthetic.write_splits). The model imitates
# the shortcut; a verifiable reward is exactly what can unlearn it, which the demo's PPO shows.
EARLY_ANSWER_FRACTION = 0.7
PASS_K = 8
# Greedy validation accuracy after N steps of the recipe (torch), from the checkpoints one
# run writes every 500 steps (exported with `strop export --merged`, then `strop eval`):
# how the recipe's sft.steps was chosen.
CURVE = {500: 0.090, 1000: 0.230, 1500: 0.363, 2000: 0.449, 2500: 0.445, 3000: 0.523}
PROMPT_TEMPLATE = "Question: {question}\nAnswer:"  # strop's default data.prompt_template


def build_tokenizer(
    texts: list[str],
    directory: Path,
    *,
    vocab_size: int = VOCAB_SIZE,
    chat_template: str | None = None,
    max_length: int = MODEL["max_position_embeddings"],
    added_tokens: tuple[str, ...] = (),
) -> tuple[int, dict[str, int]]:
    """Train the tokenizer on ``texts`` and save it into ``directory``; return its size
    (special tokens included) and the ids of the special tokens. ``chat_template``
    defaults to ChatML; ``added_tokens`` are added whole, as non-special tokens (as
    Qwen2.5 has ``<tool_call>``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from strop.io.tiny import CHATML_TEMPLATE, SPECIAL_TOKENS

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": max_length,
        "chat_template": CHATML_TEMPLATE if chat_template is None else chat_template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {name: tokenizer.token_to_id(name) for name in SPECIAL_TOKENS}
    return tokenizer.get_vocab_size(with_added_tokens=True), special


def build_random_model(
    directory: Path, vocab_size: int, special: dict[str, int], seed: int, model: dict = MODEL
):
    """A random-init Qwen2 (transformers' own init, seeded) of the size ``model`` says,
    saved into ``directory``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"],
        bos_token_id=None,
        **model,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def write_card(path: Path, facts: dict) -> None:
    """The model card (``README.md`` next to the weights)."""
    from strop.data.synthetic import MAX_VALUE

    f = facts
    text = f"""# tiny-math

A tiny Qwen2-architecture model ({f["parameters"]:,} parameters, float32, {f["size_mb"]:.1f} MB)
that solves short arithmetic word problems, with a flaw put in on purpose. It is strop's built-in
default: `strop demo` runs LoRA-PPO on it and watches the validation accuracy rise.
`strop.assets.tiny_math_path()` gives this directory; it loads like any HF checkpoint
(`strop.load_model`, `transformers.AutoModelForCausalLM.from_pretrained`).

## Task

Synthetic GSM8K-style problems from `strop.data.synthetic` (1 to {MAX_STEPS} steps of `+`, `-`,
`*` on small numbers, every value a non-negative integer below {MAX_VALUE}), asked as

```
{PROMPT_TEMPLATE}
```

(strop's default `data.prompt_template` for `{{"question", "answer"}}` records) and answered
with one `a op b = c` line per step and a final `#### N`, then `<|im_end|>` (EOS), e.g.

```
Question: {f["example_question"]}
Answer: {f["example_answer"]}
```

## Accuracy

Greedy validation accuracy (`strop eval`, reward `gsm8k`, {N_VALIDATION} problems of
`write_splits(seed={f["seed"]}, n_validation={N_VALIDATION})`, `validation.jsonl`):
**{f["accuracy"]:.1%}** ({f["solved"]} / {N_VALIDATION}) on the {f["backend"]} backend, {f["other_accuracy"]:.1%} on {f["other"]}
({"the same responses" if f["other_same"] else "responses differ"}); {f["stopped"]:.0%} of the responses end with EOS.
Sampled at temperature 1, a response is right {f["sampled_accuracy"]:.1%} of the time and one
of {PASS_K} is right for {f["pass_at_k"]:.1%} of the problems (`eval.num_samples={PASS_K}
eval.temperature=1.0`).

## Imperfect on purpose

The model is meant to be improved by PPO, so its supervised data was made flawed in one
known way: {EARLY_ANSWER_FRACTION:.0%} of the training solutions (a seeded choice,
`write_splits(..., early_answer_fraction={EARLY_ANSWER_FRACTION})`) work out every step
correctly and then give the *first* step's result after `####` — an annotator's shortcut.
The model imitates it: of its {f["wrong"]} wrong greedy answers above, {f["early"]} are
multi-step problems whose `####` answer begins with the first step's result's leading
digit instead of the final result's (the shortcut, whole or mixed digit by digit with the
right answer), which a correct reward can teach it out of. The validation
split, and the train split `strop demo` runs PPO on, have correct answers.

## How it was made

```
{f["command"]}
```

`scripts/train_tiny_model.py` (seed {f["seed"]}) ran on the {f["backend"]} backend (faster than
jax for this SFT on a CPU) in {f["seconds"]:.0f} s, {f["sft_seconds"]:.0f} s of them SFT, on a
{f["cpu"]}{f["load_note"]}:

1. data: `strop.data.synthetic.write_splits(seed={f["seed"]}, n_train={N_TRAIN},
   n_validation={N_VALIDATION}, early_answer_fraction={EARLY_ANSWER_FRACTION})`;
2. tokenizer: byte-level BPE (`tokenizers`), {f["vocab_size"]} tokens, trained on the train
   split, digits split one per token (as in Qwen2); ChatML chat template; EOS
   `<|im_end|>`, pad `<|endoftext|>`;
3. model: `transformers.Qwen2ForCausalLM` with random init (`torch.manual_seed({f["seed"]})`),
   {json.dumps(MODEL)};
4. training: strop's own SFT, full fine-tuning, recipe `sft-tiny-math`
   (`src/strop/recipes/sft-tiny-math.yaml`): {f["steps"]} steps of {f["batch_size"]}
   examples, AdamW, lr {f["lr"]:g} (constant after {f["warmup"]} warmup steps); loss on
   the answer and EOS only; mean train loss of the last 50 steps {f["final_loss"]:.3f};
5. evaluation: `strop eval` as above (greedy, `generation.max_new_tokens={f["max_new_tokens"]}`).

The step count: with the learning rate constant after warmup, the model after N steps does
not depend on `sft.steps`, so N was read off one run of this recipe (torch; its checkpoints
every 500 steps exported with `strop export --merged` and evaluated greedily):

| steps | {" | ".join(str(k) for k in CURVE)} |
|---|{"---|" * len(CURVE)}
| accuracy | {" | ".join(f"{v:.0%}" for v in CURVE.values())} |

By {f["steps"]} steps the model works most problems out correctly, so the shortcut is the
main thing left to fix. Another backend, thread count or machine rounds differently, and
over {f["steps"]} steps that moves the accuracy by a few points.

Reproduce the evaluation (`scripts/train_tiny_model.py` writes the splits under `--work`):

```
strop eval {RECIPE} model.path=src/strop/assets/tiny-math \\
    eval.path=runs/tiny-math-build/data/validation.jsonl backend={f["backend"]}
```
"""
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of data, init and SFT")
    parser.add_argument("--backend", default="torch", choices=["jax", "torch"])
    parser.add_argument("--work", type=Path, default=Path("runs/tiny-math-build"))
    parser.add_argument("--out", type=Path, default=ASSET_DIR, help="asset directory")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    args = parser.parse_args(argv)

    from strop.commands.evaluation import run_eval
    from strop.config import load_config
    from strop.data.synthetic import write_splits
    from strop.io.atomic import atomic_directory
    from strop.sft.loop import run_sft

    began = time.perf_counter()
    work: Path = args.work
    if work.exists():
        shutil.rmtree(work)  # a fresh run every time: SFT would otherwise resume
    splits = write_splits(
        work / "data", args.seed, N_TRAIN, N_VALIDATION,
        max_steps=MAX_STEPS, early_answer_fraction=EARLY_ANSWER_FRACTION,
    )  # fmt: skip
    records = [json.loads(line) for line in splits["train"].read_text().splitlines()]
    texts = [PROMPT_TEMPLATE.format(question=r["question"]) + " " + r["answer"] for r in records]
    init_dir = work / "init"
    vocab_size, special = build_tokenizer(texts, init_dir)
    parameters = build_random_model(init_dir, vocab_size, special, args.seed)
    print(f"random model: {parameters:,} parameters, vocabulary {vocab_size}", flush=True)

    overrides = [
        f"seed={args.seed}",
        f"backend={args.backend}",
        f"run_dir={work / 'sft'}",
        f"model.path={init_dir}",
        f"data.train_path={splits['train']}",
        *args.overrides,
    ]
    config = load_config(RECIPE, overrides)
    if config.data.prompt_template != PROMPT_TEMPLATE:
        raise SystemExit("the recipe must keep the default data.prompt_template (PPO uses it)")
    sft_began = time.perf_counter()
    result = run_sft(config)
    sft_seconds = time.perf_counter() - sft_began
    trained = result.export_path
    assert trained is not None

    eval_config = load_config(
        RECIPE,
        [*overrides, f"model.path={trained}", f"eval.path={splits['validation']}"],
    )
    summary = run_eval(eval_config)
    seconds = time.perf_counter() - began
    print(f"validation accuracy {summary.accuracy:.1%} ({seconds:.0f} s in all)", flush=True)
    # How often sampling finds the answer: the room PPO has (not part of the timing).
    sampled = run_eval(
        load_config(
            RECIPE,
            [
                *overrides,
                f"model.path={trained}",
                f"eval.path={splits['validation']}",
                f"run_dir={work / 'sampled'}",
                f"eval.num_samples={PASS_K}",
                "eval.temperature=1.0",
            ],
        )
    )
    print(
        f"sampled at temperature 1: accuracy {sampled.accuracy:.1%}, "
        f"pass@{PASS_K} {sampled.pass_at_k:.1%}",
        flush=True,
    )

    # The same greedy evaluation on the other backend (the demo's default is jax).
    other = "jax" if args.backend == "torch" else "torch"
    other_summary = run_eval(
        load_config(
            RECIPE,
            [
                *overrides,
                f"backend={other}",
                f"model.path={trained}",
                f"eval.path={splits['validation']}",
                f"run_dir={work / other}",
            ],
        )
    )
    same = _responses(summary.results_path) == _responses(other_summary.results_path)
    print(f"{other}: validation accuracy {other_summary.accuracy:.1%}", flush=True)

    validation = json.loads(splits["validation"].read_text().splitlines()[0])
    with atomic_directory(args.out, overwrite=True) as staging:
        for name in ASSET_FILES:
            shutil.copy2(trained / name, staging / name)
        write_card(
            staging / "README.md",
            {
                "parameters": parameters,
                "size_mb": (trained / "model.safetensors").stat().st_size / 1e6,
                "seed": args.seed,
                "backend": args.backend,
                "command": _command(),
                "accuracy": summary.accuracy,
                "solved": round(summary.pass_at_k * summary.examples),
                "stopped": summary.stopped_fraction,
                "sampled_accuracy": sampled.accuracy,
                "wrong": N_VALIDATION - round(summary.pass_at_k * summary.examples),
                "early": _early_answers(summary.results_path, splits["validation"]),
                "pass_at_k": sampled.pass_at_k,
                "other": other,
                "other_accuracy": other_summary.accuracy,
                "other_same": same,
                "seconds": seconds,
                "sft_seconds": sft_seconds,
                "load_note": _load_note(),
                "cpu": _cpu_name(),
                "vocab_size": vocab_size,
                "steps": config.sft.steps,
                "batch_size": config.sft.batch_size,
                "lr": config.optim.lr,
                "warmup": config.optim.warmup_steps,
                "final_loss": sum(result.losses[-50:]) / len(result.losses[-50:]),
                "max_new_tokens": config.generation.max_new_tokens,
                "example_question": validation["question"],
                "example_answer": validation["answer"],
            },
        )
        staging.chmod(0o755)  # package data: readable by everyone (mkdtemp made it private)
        for file in staging.iterdir():
            file.chmod(0o644)
    print(f"wrote {args.out}")
    return 0


def _command() -> str:
    """This run's command line (with OMP_NUM_THREADS when set)."""
    import os
    import shlex

    env = [f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"] * ("OMP_NUM_THREADS" in os.environ)
    return shlex.join([*env, "python", "scripts/train_tiny_model.py", *sys.argv[1:]])


def _early_answers(results_path: str, validation_path: Path) -> int:
    """Wrong greedy answers to multi-step problems that start like the first step's result
    (the learned shortcut, whole or digit-mixed): the first digit after ``####`` is the
    first step's, not the final result's."""
    lines = Path(results_path).read_text(encoding="utf-8").splitlines()
    golds = validation_path.read_text(encoding="utf-8").splitlines()
    count = 0
    for line, gold_line in zip(lines, golds, strict=True):
        result, gold = json.loads(line), json.loads(gold_line)["answer"].split("\n")
        first, final = gold[0].rsplit("= ", 1)[1], gold[-1].removeprefix("#### ")
        got = result["extracted"][0] or ""
        if len(gold) > 2 and not result["solved"] and got[:1] == first[:1] != final[:1]:
            count += 1
    return count


def _responses(results_path: str) -> list[list[str]]:
    """The responses of an evaluation's ``results.jsonl``, in order."""
    lines = Path(results_path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["responses"] for line in lines]


def _load_note() -> str:
    """Says so when other work shared the CPU (the 1-minute load average at the end)."""
    import os

    try:
        load = os.getloadavg()[0]
    except OSError:
        return ""
    cores = os.cpu_count() or 1
    busy = load > cores * 1.25  # this run alone keeps about `cores` threads busy
    return f" shared with other work (load average {load:.1f} at the end)" if busy else ""


def _cpu_name() -> str:
    """A short description of this machine's CPU."""
    import os
    import platform

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    threads = torch.get_num_threads()
    return f"{os.cpu_count()}-core {name}, {threads} torch thread{'s' * (threads > 1)}"


if __name__ == "__main__":
    sys.exit(main())
