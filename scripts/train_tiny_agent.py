"""Make the tiny tool-using model shipped in ``src/strop/assets/tiny-calc``.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_tiny_agent.py   # what made the shipped weights

It is made as ``scripts/train_tiny_model.py`` made tiny-math (whose tokenizer and model
builders it imports), all seeded by ``--seed``:

1. calculator problems and flawed tool-use demonstrations
   (``strop.agents.calculator_tasks.write_calc_splits``);
2. a byte-level BPE tokenizer trained on the rendered demonstrations (digits one per
   token; ``<tool_call>`` and ``</tool_call>`` whole, as in Qwen2.5) with :data:`TEMPLATE`,
   a short Qwen2.5-style chat template: tools listed in the system turn, calls written as
   ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (the ``hermes``
   format), results in ``tool`` turns;
3. a random-init Qwen2 built with ``transformers``;
4. full fine-tuning with strop's own SFT on the chats, recipe ``sft-tiny-calc``;
5. episodes in the ``calculator`` environment on validation problems
   (``strop.agents.rollout.run_episodes`` with the torch policy), greedy and at temperature 1:
   accuracy, how often the model calls the tool and how often its call parses;
6. the exported weights, tokenizer and a model card written into the asset directory.

The flaw, put in on purpose so that RL has something to fix: the demonstrations call the
calculator for some phrasings of a question and guess the answer (always wrongly) for
others (``strop.agents.calculator_tasks``: ``TOOL_RATES``). The model learns when the
annotator bothered; a reward for the right answer teaches it to call the tool always.
Extra ``key=value`` arguments override the recipe (``sft.steps=300``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_model import (
    ASSET_FILES,
    _cpu_name,
    _load_note,
    build_random_model,
    build_tokenizer,
)
from train_tiny_model import (
    MODEL as TINY_MATH_MODEL,
)

ROOT = Path(__file__).resolve().parents[1]
ASSET_DIR = ROOT / "src" / "strop" / "assets" / "tiny-calc"
RECIPE = "sft-tiny-calc"
MODEL = {**TINY_MATH_MODEL, "max_position_embeddings": 512}  # tiny-math's, longer chats
VOCAB_SIZE = 512
ADDED_TOKENS = ("<tool_call>", "</tool_call>")
N_TRAIN = 16000
N_VALIDATION = 128
# Episodes: what the measurements below run (the calculator environment's defaults).
MAX_TURNS = 4
MAX_NEW_TOKENS = 64
MAX_EPISODE_TOKENS = 512
TEMPERATURE_SEED = 0

# A Qwen2.5-style template, shorter: the tools as one line each in the system turn (not
# their whole JSON schemas), a tool result as a "tool" turn. Assistant turns with
# tool_calls are rendered as Qwen2.5 renders them, so `detect_format` reads "hermes".
TEMPLATE = (
    "{%- if messages[0].role == 'system' %}\n"
    "    {%- set system = messages[0].content %}\n"
    "    {%- set turns = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system = none %}\n"
    "    {%- set turns = messages %}\n"
    "{%- endif %}\n"
    "{%- if system is not none or tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if system is not none %}\n"
    "        {{- system }}\n"
    "    {%- endif %}\n"
    "    {%- if tools %}\n"
    "        {%- if system is not none %}\n"
    "            {{- '\\n\\n' }}\n"
    "        {%- endif %}\n"
    "        {{- '# Tools' }}\n"
    "        {%- for tool in tools %}\n"
    "            {%- set fn = tool.function if tool.function is defined else tool %}\n"
    "            {%- set params = fn.parameters.properties if fn.parameters is defined and fn.parameters.properties is defined else {} %}\n"
    "            {{- '\\n' ~ fn.name ~ '(' ~ (params | list | join(', ')) ~ '): ' ~ fn.description }}\n"
    "        {%- endfor %}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in turns %}\n"
    "    {%- if message.role == 'assistant' and message.tool_calls %}\n"
    "        {{- '<|im_start|>assistant' }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for call in message.tool_calls %}\n"
    "            {%- set call = call.function if call.function is defined else call %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def render(records: list[dict]) -> list[str]:
    """The demonstrations as the template renders them (what the tokenizer learns)."""
    from strop.data.tokenizer import Tokenizer

    renderer = Tokenizer(None, {}, TEMPLATE)  # type: ignore[arg-type]  (no ids needed)
    return [renderer.apply_chat_template(r["messages"], tools=r["tools"]) for r in records]


def measure(
    model_dir: Path, problems: list, *, temperature: float, seed: int, run_dir: Path, backend: str
) -> dict:
    """Episodes in the calculator environment, one per problem: accuracy, tool use and
    parsing, overall and by the phrasing's kind."""
    from strop.agents.continuation import sampler_generate
    from strop.agents.environment import resolve_environment
    from strop.agents.rollout import RolloutLimits, episode_metrics, run_episodes
    from strop.agents.tool_calls import ToolCall, parse_tool_calls
    from strop.backends import get_backend
    from strop.config import load_config
    from strop.data import Tokenizer
    from strop.generation import Decoding, SamplingParams

    overrides = [f"backend={backend}", f"model.path={model_dir}", "lora.enabled=false"]
    config = load_config("tiny", [*overrides, "mesh.fsdp=1", "mesh.data=-1", f"run_dir={run_dir}"])
    policy = get_backend(backend).build_policy(config)
    tok = Tokenizer.from_pretrained(model_dir)
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=temperature)
    decoding = Decoding(seed=seed, eos_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id)
    limits = RolloutLimits(
        max_turns=MAX_TURNS, max_episode_tokens=MAX_EPISODE_TOKENS, max_new_tokens=MAX_NEW_TOKENS
    )
    began = time.perf_counter()
    outcomes = run_episodes(
        [p.to_record() for p in problems],
        resolve_environment("calculator"),
        tok,
        sampler_generate(policy, params, decoding),
        limits,
    )
    seconds = time.perf_counter() - began
    rows = []
    for problem, outcome in zip(problems, outcomes, strict=True):
        calls = [
            call
            for message in outcome.episode.messages
            if message["role"] == "assistant"
            for call in parse_tool_calls(message["content"], "hermes").calls
        ]
        rows.append(
            {
                "careful": problem.careful,
                "correct": outcome.rewards.get("correct", 0.0),
                "calls": len(calls),
                "parsed": sum(isinstance(c, ToolCall) and c.name == "calculate" for c in calls),
                "tool_errors": outcome.info.get("tool_errors", 0.0),
                "error": outcome.error,
            }
        )

    def share(selected: list[dict], key: str = "correct") -> float | None:
        return sum(r[key] for r in selected) / len(selected) if selected else None

    called = [r for r in rows if r["calls"]]
    n_calls = sum(r["calls"] for r in rows)
    summary = {
        "temperature": temperature,
        "episodes": len(rows),
        "accuracy": share(rows),
        "call_rate": len(called) / len(rows),
        "parse_rate": sum(r["parsed"] for r in rows) / n_calls if n_calls else None,
        "calls": n_calls,
        "tool_errors": sum(r["tool_errors"] for r in rows),
        "accuracy_with_tool": share(called),
        "accuracy_without_tool": share([r for r in rows if not r["calls"]]),
        "env_errors": sum(r["error"] is not None for r in rows),
        "seconds": seconds,
        "metrics": episode_metrics(outcomes),
    }
    for kind, careful in (("careful", True), ("casual", False)):
        group = [r for r in rows if r["careful"] == careful]
        summary[f"{kind}_accuracy"] = share(group)
        summary[f"{kind}_call_rate"] = sum(bool(r["calls"]) for r in group) / max(1, len(group))
    example = next((o for o, r in zip(outcomes, rows, strict=True) if r["parsed"]), outcomes[0])
    summary["example"] = tok.decode(example.episode.ids)
    return summary


def describe(summary: dict) -> str:
    """One line of a measurement."""
    s = summary

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    return (
        f"T={s['temperature']:g}: accuracy {pct(s['accuracy'])}, calls the tool in "
        f"{pct(s['call_rate'])} of episodes ({pct(s['careful_call_rate'])} careful, "
        f"{pct(s['casual_call_rate'])} casual phrasings), {pct(s['parse_rate'])} of "
        f"{s['calls']} calls parse; accuracy with the tool {pct(s['accuracy_with_tool'])}, "
        f"without {pct(s['accuracy_without_tool'])}; {s['seconds']:.0f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of data, init and SFT")
    parser.add_argument("--backend", default="torch", choices=["jax", "torch"])
    parser.add_argument("--work", type=Path, default=Path("runs/tiny-calc-build"))
    parser.add_argument("--out", type=Path, default=ASSET_DIR, help="asset directory")
    parser.add_argument(
        "--model", type=Path, help="measure (and ship) this trained model; skip the training"
    )
    parser.add_argument(
        "--init", type=Path, help="fine-tune this model (and its tokenizer), not a random one"
    )
    parser.add_argument("--n-train", type=int, default=N_TRAIN, help="demonstrations")
    parser.add_argument("--n-validation", type=int, default=N_VALIDATION, help="episodes")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    args = parser.parse_args(argv)

    from strop.agents.calculator_tasks import TOOL_RATES, calc_splits, write_calc_splits
    from strop.config import load_config
    from strop.io.atomic import atomic_directory
    from strop.sft.loop import run_sft

    began = time.perf_counter()
    work: Path = args.work
    facts: dict = {"seed": args.seed, "backend": args.backend, "tool_rates": TOOL_RATES}
    if args.model is None:
        if work.exists():
            shutil.rmtree(work)  # a fresh run every time: SFT would otherwise resume
        splits = write_calc_splits(
            work / "data", args.seed, args.n_train, args.n_validation, demonstrations=True
        )
        records = [json.loads(line) for line in splits["sft"].read_text().splitlines()]
        facts["tool_share"] = sum(len(r["messages"]) > 3 for r in records) / len(records)
        if args.init is None:
            init_dir = work / "init"
            vocab_size, special = build_tokenizer(
                render(records),
                init_dir,
                vocab_size=VOCAB_SIZE,
                chat_template=TEMPLATE,
                max_length=MODEL["max_position_embeddings"],
                added_tokens=ADDED_TOKENS,
            )
            parameters = build_random_model(init_dir, vocab_size, special, args.seed, MODEL)
            print(f"random model: {parameters:,} parameters, vocabulary {vocab_size}", flush=True)
        else:  # a second stage: the earlier model, its tokenizer and its card's facts
            init_dir = args.init
            facts["stages"] = _earlier_stages(init_dir)
            vocab_size, parameters = _size(init_dir)
        overrides = [
            f"seed={args.seed}",
            f"backend={args.backend}",
            f"run_dir={work / 'sft'}",
            f"model.path={init_dir}",
            f"data.train_path={splits['sft']}",
            *args.overrides,
        ]
        config = load_config(RECIPE, overrides)
        sft_began = time.perf_counter()
        result = run_sft(config)
        facts["sft_seconds"] = time.perf_counter() - sft_began
        trained = result.export_path
        assert trained is not None
        facts.update(
            parameters=parameters,
            vocab_size=vocab_size,
            steps=config.sft.steps,
            batch_size=config.sft.batch_size,
            lr=config.optim.lr,
            schedule=config.optim.schedule,
            warmup=config.optim.warmup_steps,
            final_loss=sum(result.losses[-50:]) / len(result.losses[-50:]),
            trained=str(trained),
            command=_command(),
            load_note=_load_note(),
            cpu=_cpu_name(),
        )
        (work / "facts.json").write_text(json.dumps(facts, indent=1) + "\n")
    else:  # measure a model trained before (its training facts from that run, if any)
        trained = args.model
        if (work / "facts.json").is_file():
            facts = {**json.loads((work / "facts.json").read_text()), **facts}
    _, validation = calc_splits(args.seed, 0, args.n_validation)
    facts.update(n_train=args.n_train, n_validation=args.n_validation)
    facts["greedy"] = measure(
        trained, validation, temperature=0.0, seed=TEMPERATURE_SEED,
        run_dir=work / "measure", backend=args.backend,
    )  # fmt: skip
    print(describe(facts["greedy"]), flush=True)
    facts["sampled"] = measure(
        trained, validation, temperature=1.0, seed=TEMPERATURE_SEED,
        run_dir=work / "measure", backend=args.backend,
    )  # fmt: skip
    print(describe(facts["sampled"]), flush=True)
    if args.model is None or "seconds" not in facts:  # (a run measured after its training)
        facts["seconds"] = (
            time.perf_counter() - began + facts.get("sft_seconds", 0.0) * bool(args.model)
        )
    work.mkdir(parents=True, exist_ok=True)
    (work / "facts.json").write_text(json.dumps(facts, indent=1) + "\n")
    if "parameters" not in facts:
        print(f"measured {trained}; facts in {work / 'facts.json'} (no asset written)")
        return 0
    with atomic_directory(args.out, overwrite=True) as staging:
        for name in ASSET_FILES:
            shutil.copy2(trained / name, staging / name)
        facts["size_mb"] = (staging / "model.safetensors").stat().st_size / 1e6
        write_card(staging / "README.md", facts)
        staging.chmod(0o755)  # package data: readable by everyone (mkdtemp made it private)
        for file in staging.iterdir():
            file.chmod(0o644)
    print(f"wrote {args.out}")
    return 0


def write_card(path: Path, facts: dict) -> None:
    """The model card (``README.md`` next to the weights)."""
    from strop.agents.calculator import SYSTEM_PROMPT
    from strop.agents.calculator_tasks import PHRASINGS

    f, g, t = facts, facts["greedy"], facts["sampled"]

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    rows = "\n".join(
        f"| {name} | {pct(m['accuracy'])} | {pct(m['call_rate'])} | {pct(m['parse_rate'])} "
        f"| {pct(m['accuracy_with_tool'])} | {pct(m['accuracy_without_tool'])} "
        f"| {pct(m['careful_accuracy'])} / {pct(m['casual_accuracy'])} "
        f"| {pct(m['careful_call_rate'])} / {pct(m['casual_call_rate'])} |"
        for name, m in (("greedy", g), ("temperature 1", t))
    )
    rates = f["tool_rates"]
    text = f"""# tiny-calc

A tiny Qwen2-architecture model ({f["parameters"]:,} parameters, float32, {f["size_mb"]:.1f} MB)
that answers arithmetic questions by calling a calculator tool, with a flaw put in on purpose:
it calls the tool only for some phrasings of a question and guesses (wrongly) for the others.
It is made for multi-turn RL with tools (`env.name=calculator`, issue 36): a reward for the
right answer can teach it to call the tool every time. It loads like any HF checkpoint
(`strop.load_model`, `transformers.AutoModelForCausalLM.from_pretrained`).

## Task

Problems from `strop.agents.calculator_tasks` that a model this size cannot do in its head: a
product of a 2-3 digit and a 2 digit number, alone or with one more step (`a * b`,
`a * b + c`, `a * b - c`, `(a + b) * c`) in one of {len(PHRASINGS) - 2} phrasings, or one of two
one-line word problems whose answer is `a * b`. Each episode is the built-in `calculator`
environment's (`strop.agents.calculator`): its system prompt, the question, and one tool,
`calculate(expression)`; the answer is scored `correct` (the `#### N` of the last assistant
turn against the record's gold). An episode of the model, rendered:

```
{g["example"]}
```

## Chat template and tool format

`tokenizer_config.json`'s `chat_template` is a short Qwen2.5-style template: ChatML turns
(`<|im_start|>role\\n...<|im_end|>\\n`), the tools as one `name(parameters): description` line
each in the system turn (`tools=` of `apply_chat_template`), an assistant's `tool_calls`
written as Qwen2.5 writes them (`<tool_call>\\n{{"name": ..., "arguments": {{...}}}}\\n</tool_call>`:
the `hermes` format of `strop.agents.tool_calls`, which `detect_format` reads off the
template), and a tool result as a `tool` turn. `<tool_call>` and `</tool_call>` are single
(non-special) tokens, as in Qwen2.5. EOS is `<|im_end|>`, pad `<|endoftext|>`. The system prompt
the model was trained with is the environment's:

> {SYSTEM_PROMPT}

## Accuracy

Episodes in the `calculator` environment on the {g["episodes"]} validation problems of
`calc_splits(seed={f["seed"]}, n_validation={f["n_validation"]})`, played by
`strop.agents.rollout.run_episodes` with the {f["backend"]} policy as sampler (at most
{MAX_TURNS} turns, {MAX_NEW_TOKENS} new tokens a turn; temperature 1 with seed {TEMPERATURE_SEED}):

| sampling | accuracy | calls the tool | calls that parse | accuracy with the tool | without | accuracy careful / casual | calls careful / casual |
|---|---|---|---|---|---|---|---|
{rows}

"Calls the tool": the share of episodes with at least one call; "careful / casual": the
phrasings the demonstrations mostly solved with the tool / mostly guessed (below).

## Imperfect on purpose

In the supervised demonstrations (`write_calc_splits(..., demonstrations=True)`), the
annotator called the calculator for {rates["careful"]:.0%} of the questions in the careful
phrasings ("What is ...?", "Calculate ...", the boxes word problem) and for only
{rates["casual"]:.0%} in the casual ones ("Work out ...", "How much is ...?", "Find ...",
the bags word problem); otherwise the demonstration answers at once with a guess, the
right answer with its last two digits made up (never right). {f.get("tool_share", 0):.0%} of
the demonstrations use the tool. The model imitates this: greedy, it calls the tool for
{pct(g["careful_call_rate"])} of the careful and {pct(g["casual_call_rate"])} of the casual
questions, and is right {pct(g["accuracy_with_tool"])} of the time when it calls the tool,
{pct(g["accuracy_without_tool"])} when it does not. At temperature 1 it calls the tool for
{pct(t["casual_call_rate"])} of the casual questions: the exploration a correctness reward
needs to make it call the tool everywhere (ceiling: about the accuracy with the tool).

## How it was made

```
{f["command"]}
```

`scripts/train_tiny_agent.py` (seed {f["seed"]}) ran on the {f["backend"]} backend in
{f["seconds"]:.0f} s, {f["sft_seconds"]:.0f} s of them SFT, on a {f["cpu"]}{f["load_note"]}:

1. data: `strop.agents.calculator_tasks.write_calc_splits(seed={f["seed"]}, n_train={f["n_train"]},
   n_validation={f["n_validation"]}, demonstrations=True)`: one demonstration per train problem
   (`messages` and `tools`, the OpenAI / Hugging Face chat format);
{_origin(f)}
4. training: strop's own SFT on the chats, full fine-tuning, recipe `{RECIPE}`
   (`src/strop/recipes/{RECIPE}.yaml`): {f["steps"]} steps of {f["batch_size"]} chats,
   AdamW, lr {f["lr"]:g} ({_schedule(f)}); loss on the assistant
   turns only (the call and the answer, not the tool's result); mean train loss of the last
   50 steps {f["final_loss"]:.3f};
5. evaluation: episodes as above.

Reproduce the measurements of a model (the splits are a function of the seed):

```
python scripts/train_tiny_agent.py --model src/strop/assets/tiny-calc --work runs/tiny-calc-check
```
"""
    path.write_text(text, encoding="utf-8")


def _schedule(f: dict) -> str:
    """How the learning rate of a stage went."""
    decay = {"constant": "constant", "linear": "linear decay to 0", "cosine": "cosine decay to 0"}
    return f"{decay[f.get('schedule', 'constant')]} after {f['warmup']} warmup steps"


def _origin(f: dict) -> str:
    """Items 2 and 3 of the card's list: where the tokenizer and the first weights came from."""
    if not f.get("stages"):
        return f"""2. tokenizer: byte-level BPE (`tokenizers`) trained on the rendered demonstrations,
   {f["vocab_size"]} tokens, digits one per token (as in Qwen2), `<tool_call>` and
   `</tool_call>` added whole (the builder of `scripts/train_tiny_model.py`);
3. model: `transformers.Qwen2ForCausalLM` with random init (`torch.manual_seed({f["seed"]})`),
   {json.dumps(MODEL)};"""
    stages = "\n".join(
        f"   - `{s['command']}`: {s.get('steps', '?')} steps of {s.get('batch_size', '?')} chats "
        f"on {s.get('n_train', '?')} demonstrations, lr {s.get('lr', '?')} "
        f"({_schedule({'warmup': '?', **s})}), {s.get('sft_seconds', 0):.0f} s of SFT"
        for s in f["stages"]
    )
    return f"""2-3. tokenizer and first weights: the model `--init` names, made by (oldest first;
   the first stage built the byte-level BPE tokenizer, {f["vocab_size"]} tokens, digits one
   per token, `<tool_call>` and `</tool_call>` whole, and the random-init
   `transformers.Qwen2ForCausalLM` {json.dumps(MODEL)}):
{stages}"""


def _earlier_stages(model_dir: Path) -> list[dict]:
    """The training stages that made ``model_dir`` (from the ``facts.json`` kept in the
    asset), oldest first; a model without one counts as one stage of unknown making."""
    path = model_dir / "facts.json"
    if not path.is_file():
        return [{"command": f"(unrecorded: the model in {model_dir})"}]
    earlier = json.loads(path.read_text())
    keys = ("command", "steps", "batch_size", "lr", "schedule", "warmup", "n_train", "sft_seconds")
    return [*earlier.get("stages", []), {k: earlier[k] for k in keys if k in earlier}]


def _size(model_dir: Path) -> tuple[int, int]:
    """The vocabulary and parameter count of a saved model."""
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    return config["vocab_size"], sum(int(w.size) for w in weights.values())


def _command() -> str:
    """This run's command line (with OMP_NUM_THREADS when set)."""
    import os
    import shlex

    env = [f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"] * ("OMP_NUM_THREADS" in os.environ)
    return shlex.join([*env, "python", "scripts/train_tiny_agent.py", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
