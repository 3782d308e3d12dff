"""The TRL contender of benchmarks/race.py: TRL's GRPOTrainer on the race's task, run in the
TRL venv (`make trl-venv`, .venv-trl) as its own process so its RSS and time are its own.

The rollout is the task's two turns, built from the task's own modules (nothing copied):
- turn 1, trained by TRL: the prompt is rendered exactly as squall's inference server renders
  the agent's first request (squall.inference.prompt.ChatFormat with the task's tools, then the
  parser's tool_choice prefill), handed to TRL as plain text, so TRL never applies a chat
  template of its own (and never refuses SmolLM2's template for tools);
- turn 2, not trained: inside the reward function, the call is parsed with the same parser,
  the task's tool runs, and the current policy writes the answer from the same rendering of
  the conversation, sampled with the same settings; the task's reward_of grades the attempt.

Writes into --out: ckpt-<step>/ (Hugging Face folders: the model, or with LoRA the adapter
alone as squall publishes it, and the base folder's tokenizer files), checkpoints.jsonl (step, seconds since start, path) and stats.json
(generation seconds, step seconds, generated tokens, wall seconds).

    .venv-trl/bin/python benchmarks/race_trl.py --model runs/models/smollm2-135m-instruct \\
        --data runs/race/data/train.jsonl --out runs/race/trl --minutes 15 --params '{...}'
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BASE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def turn_one_prompt(chat: Any, task_agent: Any, question: str) -> str:
    """The text squall's server samples turn 1 from: the template's rendering plus the prefill."""
    messages = [*getattr(task_agent, "DEMONSTRATION", []), {"role": "user", "content": question}]
    name = task_agent.FORCE_CALCULATOR["function"]["name"]
    return chat.render(messages, task_agent.TOOLS) + chat.parser.forced_prefix(name)


def make_reward(chat: Any, agent: Any, answer: Any, stats: dict[str, Any]) -> Any:
    """TRL's reward function: parse turn 1 as squall's server does, run the tool, let `answer`
    write turn 2 from the current policy, grade with the task's reward_of."""
    from examples.calc.agent import run_tool

    prefix = chat.parser.forced_prefix(agent.FORCE_CALCULATOR["function"]["name"])

    def reward(prompts: list[str], completions: list[str], row: list[str], **_: Any) -> list[float]:
        began = time.perf_counter()
        rewards = []
        for completion, raw in zip(completions, row, strict=True):
            task = json.loads(raw)
            # squall's server stops turn 1 at </tool_call>; TRL samples on to the token limit
            parsed = chat.parser.parse((prefix + completion).split("</tool_call>")[0] + "</tool_call>")
            calls = parsed.calls or []
            results: list[str] = []
            final = None
            if calls:
                messages: list[dict] = [
                    *getattr(agent, "DEMONSTRATION", []),
                    {"role": "user", "content": task["question"]},
                    {"role": "assistant", "content": parsed.content or "", "tool_calls": calls},
                ]
                for call in calls:
                    results.append(run_tool(call["function"]["name"], call["function"]["arguments"]))
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": results[-1]})
                final, n = answer(messages)
                stats["generated_tokens"] += n
            rewards.append(agent.reward_of(task, bool(calls), results, final))
        stats["answer_s"] += time.perf_counter() - began
        return rewards

    return reward


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--task", default="examples.calc_real")
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--max-steps", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--params", default="{}", help="JSON: the matched hyperparameters")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (squall's processes use 1 each)"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cuda: the first GPU, fp32 weights under bf16 autocast (TRL's bf16=True), as squall's trainer",
    )  # fmt: skip
    args = parser.parse_args(argv)
    started = time.time()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from squall.inference.prompt import ChatFormat
    from squall.shared.transformers_compat import checkpointing_argument

    agent = importlib.import_module(f"{args.task}.agent")
    p = json.loads(args.params)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(p.get("seed", 0))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # the run file's template and parser, as squall's inference node renders and parses
    template = str(ROOT / p["chat_template"]) if p.get("chat_template") else ""
    chat = ChatFormat(tokenizer, tool_parser=p.get("tool_parser", "auto"), chat_template=template)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    prompts = [turn_one_prompt(chat, agent, row["question"]) for row in rows]
    dataset = Dataset.from_dict({"prompt": prompts, "row": [json.dumps(r) for r in rows]})
    on_gpu = args.device == "cuda"
    stats: dict[str, Any] = {"gen_s": 0.0, "answer_s": 0.0, "step_s": 0.0, "save_s": 0.0, "generated_tokens": 0,
                             "steps": 0, "device": torch.cuda.get_device_name(0) if on_gpu else "cpu"}  # fmt: skip
    holder: dict[str, Any] = {}

    def answer(messages: list[dict]) -> tuple[str, int]:
        """Turn 2 from the current policy, sampled as squall's server samples it."""
        model = holder["trainer"].model
        ids = tokenizer(chat.render(messages, agent.TOOLS), return_tensors="pt").input_ids.to(model.device)
        with torch.no_grad():
            was_training = model.training
            model.eval()
            out_ids = model.generate(
                ids, do_sample=True, temperature=p["temperature"], top_p=1.0, top_k=0,
                max_new_tokens=agent.ANSWER_TOKENS, pad_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
            model.train(was_training)
        new = out_ids[0, ids.shape[1] :]
        return tokenizer.decode(new, skip_special_tokens=True), int(new.numel())

    reward = make_reward(chat, agent, answer, stats)

    class Timed(GRPOTrainer):
        """Times generation (TRL's turn 1 plus scoring, which samples turn 2) apart from the step."""

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            began = time.perf_counter()
            result = super()._generate_and_score_completions(inputs)
            stats["gen_s"] += time.perf_counter() - began
            mask = result.get("completion_mask")
            if mask is not None:
                stats["generated_tokens"] += int(mask.sum())
            return result

    class Checkpoints(TrainerCallback):
        """Save every `save_every` steps as a Hugging Face folder, dated from the start; stop at
        the time limit."""

        def on_step_begin(self, targs: Any, state: Any, control: Any, **_: Any) -> None:
            self.began = time.perf_counter()

        def on_step_end(self, targs: Any, state: Any, control: Any, **_: Any) -> None:
            stats["step_s"] += time.perf_counter() - self.began
            stats["steps"] = state.global_step
            elapsed = time.time() - started
            if state.global_step % args.save_every == 0:
                save(state.global_step, elapsed)
            if args.minutes and elapsed > args.minutes * 60:
                control.should_training_stop = True

    def save(step: int, elapsed: float) -> None:
        """The race's checkpoint (squall's counterpart is its weight publication, which it does anyway)."""
        began = time.perf_counter()
        folder = out / f"ckpt-{step:06d}"
        holder["trainer"].model.save_pretrained(folder, safe_serialization=True)
        for name in BASE_FILES:
            source = Path(args.model) / name
            if source.is_file():
                (folder / name).write_bytes(source.read_bytes())
        with open(out / "checkpoints.jsonl", "a") as log:
            log.write(json.dumps({"step": step, "time_s": elapsed, "path": str(folder)}) + "\n")
        stats["save_s"] += time.perf_counter() - began

    config = GRPOConfig(
        output_dir=str(out / "trl_output"),
        use_cpu=not on_gpu,
        seed=p.get("seed", 0),
        num_generations=p["group_size"],
        per_device_train_batch_size=p["group_size"] * p["groups_per_step"],
        gradient_accumulation_steps=1,
        num_iterations=1,
        learning_rate=p["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        optim="adamw_torch",
        max_grad_norm=p["grad_clip"],
        epsilon=p["clip_low"],
        epsilon_high=p["clip_high"],
        beta=p["kl_coef"],
        loss_type="dapo",
        scale_rewards="group",
        max_completion_length=agent.CALL_TOKENS,
        temperature=p["temperature"],
        top_p=1.0,
        top_k=0,
        **checkpointing_argument(GRPOConfig, p["gradient_checkpointing"]),
        max_steps=args.max_steps or 100000,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=on_gpu,  # autocast over fp32 weights, as squall's trainer on CUDA
        shuffle_dataset=True,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    peft_config = None
    if p.get("lora_rank"):  # the same adapters as squall's trainer.lora_* (peft in both)
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=p["lora_rank"], lora_alpha=p["lora_alpha"], lora_dropout=p["lora_dropout"],
            target_modules=p["lora_target_modules"], task_type="CAUSAL_LM",
        )  # fmt: skip
    trainer = Timed(
        peft_config=peft_config,
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Checkpoints()],
    )
    holder["trainer"] = trainer
    trainer.train()
    stats["wall_s"] = time.time() - started
    (out / "stats.json").write_text(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
