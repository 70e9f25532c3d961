"""Time-to-reward on a multi-turn tool-using task: TRL's `GRPOTrainer` (tools=) against our loop.

    python benchmarks/agent_vs_trl.py [--steps 10] [--ours-steps N] [--seed 0] [--group-size 8]
                                      [--problems-per-step 4] [--learning-rate 1e-3]
                                      [--trl-first-turn prefill|free] [--skip-ours] [--skip-trl]

The task is examples/tool_agent.py, imported from the file: the calculator agent on the default
model (SmolLM2-135M-Instruct), CPU. Each episode asks "Use the calculator to compute {a} * {b},
then reply with only the result."; the agent may call `calculate` and gets the result back, up
to MAX_TURNS (3) assistant turns of at most 48 new tokens each; reward 0.8 for a correct final
answer (a call computed it) + 0.2 when a `calculate` call computed the product. Both sides see
the same problems (the example's seeded generator), 4 problems x 8 episodes per step, learning
rate 1e-3, LoRA r=8 alpha=16 on the 7 projections (art's LORA_DEFAULTS), temperature 1.0.

  ours  the example's `main(steps, seed, ...)`, unchanged: its rows carry wall-clock since the
        start (training included), success and reward per step.
  trl   `GRPOTrainer(tools=[calculate], reward_funcs=[...], peft_config=LoRA)` on the very same
        float32 weights (the folder `art.base_models.resolve` de-quantised from the bundled GGUF),
        TRL's own multi-turn tool loop, `max_tool_calling_iterations = MAX_TURNS - 1`, 48 new
        tokens per turn (`generation_kwargs`), and the optimizer settings ours uses (constant lr,
        AdamW betas (0.9, 0.99), weight decay 0.1, grad-norm clip, beta 0, clip 0.2, token-level
        "dapo" loss, group-scaled advantages). A callback records the wall-clock (from
        `on_train_begin`, i.e. after loading, as ours starts after `register`) at each step's end.

What TRL 1.16 needs, and what this script changes so that it runs the task (trl/trainer/
grpo_trainer.py, trl/chat_template_utils.py):
  1. A chat template that renders tool calls and tool results: `supports_tool_calling` must
     pass or the trainer raises (grpo_trainer.py:650). SmolLM2's template prints only each
     message's `content`, so it fails. Our server handles such templates by writing the Hermes
     convention out as text (art/chat_template.py: a `<tools>` preamble in the system message,
     `<tool_call>` JSON blocks, `<tool_response>` results). TRL's tokenizer gets a template that
     renders exactly that, and the preamble (the example's TOOLS schema, from our
     `tool_preamble`) is the dataset's system message, because TRL would render the schema that
     `get_json_schema` derives from the Python function (no `pattern`, other descriptions).
     `check_same_prompt` asserts, before training, that TRL's rendering of a first turn and of
     a turn after a tool result equals our server's, character for character.
  2. A parser for the completions: TRL sets one only for the templates it knows
     (`add_response_schema`, chat_template_utils.py:686, raises otherwise). We set TRL's own
     Qwen3 `response_template` (`<tool_call>` JSON blocks after `<|im_start|>assistant\\n`,
     the chatml tokens SmolLM2 uses too).
  3. THE ONE TASK DIFFERENCE: ours forces the whole first turn to be one valid call
     (`tool_choice="required"`: constrained decoding to `<tool_call>\\n{"name": "calculate",
     "arguments": {"expression": "<pattern>"}}\\n</tool_call>`). TRL has no tool_choice and no
     per-turn constraint: transformers generation runs unconstrained, and its only structured
     output option (`vllm_structured_outputs_regex`) needs vLLM and applies to every turn. Left
     free (`--trl-first-turn free`), the base model almost never writes a `<tool_call>` block,
     so every episode scores 0 and TRL has no signal to learn from. The default,
     `--trl-first-turn prefill`, is the closest TRL can run: the template writes the forced
     call's text up to the expression, `<tool_call>\\n{"name": "calculate", "arguments":
     {"expression": "`, after the first turn's assistant header (through GRPOConfig's
     `chat_template_kwargs`; TRL's parser reads the prompt's tail, so the call parses); the
     model writes the expression and closes the call, unconstrained, and those prefilled tokens
     are prompt: not trained, and not counted in the turn's 48 new tokens. `called_tool` in
     the JSON (share of TRL episodes whose first turn parsed as a call) shows what the weaker
     forcing costs.
  Also: TRL runs each turn's generation as one batched `generate` (tool results spliced in as
  token ids) and counts the whole conversation against `max_completion_length`, set here to
  MAX_TURNS x 48 + 64 tokens: three full turns plus room for two short tool results.

Prints a per-step table for both, then: wall-clock to reach success >= 0.5 for each (or "not
reached"), their ratio ours / TRL (goal <= 1/3), and the success of ours' last step that ended
within TRL's wall-clock for its steps; then one JSON line (the last line of stdout). Steps are
noisy (32 episodes); the first step of each side includes its warm-up.

TRL computes one group per micro-batch (per_device_train_batch_size = --group-size, gradient
accumulation over the problems: still one generation of 32 per optimizer step); one 32-sequence
forward was killed by the kernel at 24 GB on the 2-core machine. Needs trl and datasets
(`pip install -e '.[bench]'`; e.g. `pip install --no-deps trl==1.16.0` and datasets with its small
deps, leaving torch, transformers and peft as they are). Dated runs: benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import random
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from _common import environment, installed_version, ratio, table

import art
from art.chat_template import ChatMessage, template_messages, tool_preamble
from art.training.options import ADAMW_BETAS, ADAMW_WEIGHT_DECAY, LORA_DEFAULTS, TrainOptions

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tool_agent.py"
SUCCESS_THRESHOLD = 0.5
TOOL_RESULT_ROOM = 64  # tokens for the tool results inside TRL's max_completion_length


def load_example():
    spec = importlib.util.spec_from_file_location("tool_agent", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = load_example()

# SmolLM2's own template, plus the Hermes text our server writes for templates without tool
# support (art/chat_template.py: `call_block`, `_history_as_text`). It ignores `tools`: the
# preamble comes in the system message (see the module docstring).
CALCULATOR_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set content = message['content'] or '' %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- set blocks = namespace(text='') %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set body = {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson %}"
    "{%- set blocks.text = blocks.text + ('' if loop.first else '\\n') + '<tool_call>\\n' + body + '\\n</tool_call>' %}"
    "{%- endfor %}"
    "{%- set content = (content + '\\n' + blocks.text) if content else blocks.text %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- set content = '<tool_response>\\n' + content + '\\n</tool_response>' %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if prefill_tool_call and messages[-1]['role'] == 'user' %}{{- prefill_tool_call }}{%- endif %}"
    "{%- endif %}"
)
# TRL's stand-in for ours' forced first turn (--trl-first-turn prefill): the start of the only call
# our grammar allows, written after the assistant header of the first turn only (the last message
# is the user's); the model writes the expression and closes the call itself.
FIRST_CALL_PREFILL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "'


def calculate(expression: str) -> str:
    """Multiply two whole numbers, e.g. 12 * 34.

    Args:
        expression: The product to compute, e.g. "12 * 34".
    """
    return example.calculate(json.dumps({"expression": expression}))


def first_request(a: int, b: int) -> dict:
    """The keyword arguments of the example rollout's first chat request (messages, tools,
    tool_choice, max_tokens), captured by running `rollout` against a recording client: TRL's
    prompt and per-turn token limit come from the example itself, not from a copy."""

    class Captured(Exception):
        pass

    request: dict = {}

    async def create(**kwargs):
        request.update(kwargs)
        raise Captured

    recorder = SimpleNamespace(
        openai_client=lambda: SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create))),
        get_inference_name=lambda: "recorder")
    try:
        asyncio.run(example.rollout(recorder, a, b, seed=0))
    except Captured:
        return request
    raise RuntimeError("the example's rollout made no chat request")


def step_problems(step: int, problems_per_step: int, seed: int) -> list[tuple[int, int]]:
    """The example's problem generator for one step (its `main`: same seed, same draws)."""
    rng = random.Random(seed * 10_000 + step)
    return [(rng.randint(11, 99), rng.randint(11, 99)) for _ in range(problems_per_step)]


def trl_prompt(a: int, b: int) -> list[dict]:
    """TRL's prompt: the preamble our server adds for TOOLS as the system message, then the
    example's own user message."""
    return [{"role": "system", "content": tool_preamble(example.TOOLS)}, *first_request(a, b)["messages"]]


def check_same_prompt(tokenizer_with_tool_template, base_tokenizer, prefill: str) -> None:
    """Raise unless TRL's rendering equals our server's, for a first turn (plus `prefill`) and
    for the turn after a tool result (so the two systems' models read the same text)."""
    a, b = 12, 34
    request = first_request(a, b)
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculate", "arguments": json.dumps({"expression": f"{a} * {b}"})}}
    after_call = [*request["messages"], {"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_0", "content": str(a * b)}]
    # TRL's shapes: arguments as a mapping (parse_response), tool messages named after the tool.
    trl_after_call = [*trl_prompt(a, b),
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"type": "function", "function": {"name": "calculate",
                                                            "arguments": {"expression": f"{a} * {b}"}}}]},
                      {"role": "tool", "name": "calculate", "content": str(a * b)}]
    cases = [(request["messages"], trl_prompt(a, b), request["tool_choice"], prefill),
             (after_call, trl_after_call, "auto", "")]
    for ours_messages, trl_messages, tool_choice, added in cases:
        as_server_sees = [ChatMessage(**m).for_template() for m in ours_messages]  # as art/server/app.py does
        messages, tools = template_messages(base_tokenizer, as_server_sees, example.TOOLS, tool_choice)
        ours = base_tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        theirs = tokenizer_with_tool_template.apply_chat_template(
            trl_messages, tools=[calculate], add_generation_prompt=True, tokenize=False, prefill_tool_call=prefill)
        if ours + added != theirs:
            raise AssertionError(f"TRL's prompt differs from ours:\nours: {ours!r}\ntrl:  {theirs!r}")


def score_conversation(messages: list[dict], a: int, b: int) -> dict:
    """The example's reward, read from TRL's completion (assistant and tool messages in order):
    the final answer is the last assistant turn when it has no tool call (as in `rollout`)."""
    computed = any(m["role"] == "tool" and str(m["content"]) == str(a * b) for m in messages)
    last = messages[-1] if messages else {}
    answer = last.get("content") if last.get("role") == "assistant" and not last.get("tool_calls") else None
    success = computed and example.first_number(answer) == str(a * b)
    return {"success": float(success), "valid_tool_call": float(computed),
            "reward": example.SUCCESS_REWARD * success + example.TOOL_REWARD * computed,
            "called_tool": float(bool(messages and messages[0].get("tool_calls")))}


def run_trl(args: argparse.Namespace, root: str) -> list[dict]:
    """TRL's GRPOTrainer with its tool loop on the example's problems; one row per step."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    torch.manual_seed(args.seed)
    folder = art.base_models.resolve(art.DEFAULT_MODEL)  # the de-quantised bundled weights
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CALCULATOR_CHAT_TEMPLATE
    tokenizer.response_template = qwen3_template
    prefill = FIRST_CALL_PREFILL if args.trl_first_turn == "prefill" else ""
    check_same_prompt(tokenizer, AutoTokenizer.from_pretrained(folder), prefill)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    max_tokens_per_turn = first_request(12, 34)["max_tokens"]

    # One row per problem in our order; with shuffling off TRL's sampler repeats each row
    # num_generations times, so TRL's step k sees exactly our step k's problems.
    dataset = Dataset.from_list([{"prompt": trl_prompt(a, b), "a": a, "b": b}
                                 for step in range(args.steps)
                                 for a, b in step_problems(step, args.problems_per_step, args.seed)])
    batch_stats: list[dict] = []

    def calculator_reward(prompts, completions, a, b, **_) -> list[float]:
        scores = [score_conversation(c, x, y) for c, x, y in zip(completions, a, b)]
        batch_stats.append({key: sum(s[key] for s in scores) / len(scores) for key in scores[0]})
        return [s["reward"] for s in scores]

    rows: list[dict] = []

    class StepClock(TrainerCallback):
        """Wall-clock since training began and the step's rollout statistics, at each step's end."""

        def on_train_begin(self, *_, **__):
            self.start = time.monotonic()

        def on_step_end(self, *_, **__):
            rows.append({"step": len(rows), **batch_stats[-1], "seconds": time.monotonic() - self.start})
            row = rows[-1]
            print(f"trl step {row['step']}: success {row['success']:.2f}  reward {row['reward']:.3f}  "
                  f"valid tool calls {row['valid_tool_call']:.2f}  first turn calls {row['called_tool']:.2f}  "
                  f"({row['seconds']:.0f} s)", flush=True)

    options = TrainOptions()
    clip_low, clip_high = options.clip_range()
    config = GRPOConfig(
        output_dir=str(Path(root) / "trl"), use_cpu=True, bf16=False, fp16=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, seed=args.seed, max_steps=args.steps,
        # One generation of problems x group size per optimizer step, as ours, computed one group
        # at a time: a single 32-sequence forward with full-vocabulary logits ran out of 24 GB.
        per_device_train_batch_size=args.group_size, gradient_accumulation_steps=args.problems_per_step,
        num_generations=args.group_size, shuffle_dataset=False,
        max_tool_calling_iterations=example.MAX_TURNS - 1,  # a call, then up to 2 more turns
        generation_kwargs={"max_new_tokens": max_tokens_per_turn},  # per turn, as ours' max_tokens
        max_completion_length=example.MAX_TURNS * max_tokens_per_turn + TOOL_RESULT_ROOM,  # whole conversation
        temperature=1.0, top_p=1.0, top_k=0,
        chat_template_kwargs={"prefill_tool_call": prefill},
        # The update ours makes (art.training.options): constant lr, its AdamW, clip and loss.
        learning_rate=args.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=ADAMW_BETAS[0], adam_beta2=ADAMW_BETAS[1], weight_decay=ADAMW_WEIGHT_DECAY,
        max_grad_norm=options.max_grad_norm, beta=options.beta, epsilon=clip_low, epsilon_high=clip_high,
        loss_type="dapo", scale_rewards="group",
        activation_checkpointing=False,  # transformers 5.24's name for gradient_checkpointing
    )
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[calculator_reward], args=config,
        train_dataset=dataset, tools=[calculate], callbacks=[StepClock()],
        peft_config=LoraConfig(**LORA_DEFAULTS, task_type="CAUSAL_LM"),
    )
    trainer.train()
    del trainer, model
    gc.collect()
    return rows


def run_ours(args: argparse.Namespace, root: str) -> list[dict]:
    """The example's own training loop; its rows already carry wall-clock since the start."""
    return asyncio.run(example.main(steps=args.ours_steps, seed=args.seed, group_size=args.group_size,
                                    problems_per_step=args.problems_per_step,
                                    learning_rate=args.learning_rate, path=str(Path(root) / "ours"), quiet=True))


def time_to_success(rows: list[dict] | None) -> float | None:
    """Wall-clock at the end of the first step whose success >= SUCCESS_THRESHOLD; None if none."""
    return next((round(r["seconds"], 1) for r in rows or [] if r["success"] >= SUCCESS_THRESHOLD), None)


def success_within(rows: list[dict] | None, seconds: float | None) -> float | None:
    """Success of the last step that ended within `seconds`; None if none did."""
    inside = [r for r in rows or [] if seconds is not None and r["seconds"] <= seconds]
    return round(inside[-1]["success"], 4) if inside else None


def rounded(rows: list[dict] | None) -> list[dict] | None:
    return None if rows is None else [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                                      for r in rows]


def per_step_table(ours: list[dict] | None, trl: list[dict] | None) -> str:
    def cells(rows, step):
        if rows is None or step >= len(rows):
            return [None, None, None, None]
        r = rows[step]
        return [f"{r['seconds']:.1f}", f"{r['success']:.2f}", f"{r['reward']:.3f}", f"{r['valid_tool_call']:.2f}"]

    steps = max(len(ours or []), len(trl or []))
    return table(["step", "ours s", "success", "reward", "tool ok", "trl s", "success", "reward", "tool ok"],
                 [[step, *cells(ours, step), *cells(trl, step)] for step in range(steps)])


def goal_met(ours_time: float | None, trl_time: float | None, ours_rows: list[dict] | None,
             trl_rows: list[dict] | None) -> bool | None:
    """ours' time-to-0.5 <= 1/3 of TRL's. When TRL never got there its time is at least its
    total wall-clock, so ours within a third of that also meets the goal; otherwise undecided."""
    if not trl_rows or not ours_rows:
        return None
    if ours_time is None:
        return False
    if trl_time is not None:
        return ours_time <= trl_time / 3
    return True if ours_time <= trl_rows[-1]["seconds"] / 3 else None


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="art-agent-vs-trl-") as root:
        trl_rows, trl_status = None, "skipped (--skip-trl)"
        if not args.skip_trl:
            try:
                import datasets as _  # noqa: F401  (only the imports are checked here)
                import trl as _  # noqa: F401,F811
            except ImportError as exc:
                trl_status = f"unavailable: {exc} (pip install -e '.[bench]')"
                print(trl_status, flush=True)
            else:
                trl_rows, trl_status = run_trl(args, root), "ok"
        ours_rows = None if args.skip_ours else run_ours(args, root)

    print()
    print(per_step_table(ours_rows, trl_rows))
    ours_time, trl_time = time_to_success(ours_rows), time_to_success(trl_rows)
    trl_total = round(trl_rows[-1]["seconds"], 1) if trl_rows else None
    ours_within = success_within(ours_rows, trl_total)
    time_ratio = ratio(ours_time, trl_time)
    print()
    for label, value in (("ours", ours_time), ("trl", trl_time)):
        shown = "skipped" if value is None and (ours_rows if label == "ours" else trl_rows) is None else \
            "not reached" if value is None else f"{value:.1f} s"
        print(f"time to success >= {SUCCESS_THRESHOLD}: {label} {shown}")
    print(f"ratio ours / trl: {time_ratio if time_ratio is not None else '-'} (goal <= 0.33)")
    if trl_total is not None and ours_rows is not None:
        print(f"ours' success within TRL's wall-clock for {len(trl_rows)} steps ({trl_total:.1f} s): "
              f"{'-' if ours_within is None else f'{ours_within:.2f}'}"
              + (f"  (ours ran all its {len(ours_rows)} steps in {ours_rows[-1]['seconds']:.1f} s; "
                 "--ours-steps gives it more)" if ours_rows[-1]["seconds"] < trl_total else ""))

    report = {
        "benchmark": "agent_vs_trl",
        "ours": {"time_to_success_s": ours_time, "rows": rounded(ours_rows)} if ours_rows is not None else None,
        "trl": {"time_to_success_s": trl_time, "total_s": trl_total, "rows": rounded(trl_rows)}
        if trl_rows is not None else None,
        "ratio_time_to_success": time_ratio,  # ours / trl; None unless both reached the threshold
        "ours_success_within_trl_wallclock": ours_within,
        "goals": {"time_to_success_le_third_of_trl": goal_met(ours_time, trl_time, ours_rows, trl_rows)},
        "settings": {
            "task": "examples/tool_agent.py", "model": art.DEFAULT_MODEL, "device": "cpu",
            "success_threshold": SUCCESS_THRESHOLD, "steps": args.steps, "ours_steps": args.ours_steps,
            "problems_per_step": args.problems_per_step, "group_size": args.group_size,
            "learning_rate": args.learning_rate, "seed": args.seed, "max_turns": example.MAX_TURNS,
            "max_tokens_per_turn": first_request(12, 34)["max_tokens"], "lora": LORA_DEFAULTS,
            "trl_first_turn": args.trl_first_turn,
            "task_difference": "ours forces the whole first turn to be one valid calculate call "
                               "(tool_choice=required, constrained decoding); TRL cannot constrain a turn: "
                               + ("its first turn starts with the call's text up to the expression (prefill), "
                                  "the model writes the rest" if args.trl_first_turn == "prefill"
                                  else "its first turn is free"),
            "trl_config": "use_cpu, tools=[calculate], max_tool_calling_iterations=MAX_TURNS-1, "
                          "generation_kwargs max_new_tokens per turn, max_completion_length "
                          f"MAX_TURNS*max_tokens+{TOOL_RESULT_ROOM}, constant lr, AdamW/clip/grad-norm as ours, "
                          "beta 0, loss dapo, shuffle off; chat template = SmolLM2's + Hermes tool text, "
                          "response_template = TRL's qwen3_template",
            "seconds": "wall-clock since training began (after loading), at each step's end",
        },
        "trl_status": trl_status,
    }
    report["trl_version"] = installed_version("trl")
    report.update(environment())
    print(json.dumps(report))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps for each side")
    parser.add_argument("--ours-steps", type=int, default=None,
                        help="steps for ours (default --steps); more lets it fill TRL's wall-clock")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=8, help="episodes per problem (num_generations)")
    parser.add_argument("--problems-per-step", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--trl-first-turn", choices=["prefill", "free"], default="prefill",
                        help="prefill: TRL's first turn starts with the call up to the expression; "
                             "free: unforced (the base model then almost never calls)")
    parser.add_argument("--skip-ours", action="store_true", help="run only TRL")
    parser.add_argument("--skip-trl", action="store_true", help="run only ours")
    arguments = parser.parse_args()
    arguments.ours_steps = arguments.ours_steps or arguments.steps
    main(arguments)
