"""What the evaluation's sampler changes: a run's adapters evaluated with the sampler evaluations used before issue 54
(a GenerationConfig of do_sample and temperature only, where transformers fills in top_k 50) and with the run's own
(evaluation.generation_config: TRL's, top_k 0 unless the run set it), side by side on the same seeds: the run's
held-out games (the first of them also the sampling seed, as the trainer's evaluation has it).

    python bench/bench_sampler.py outputs/cpu-demo                     # final/, 64 samples, 16 held-out games
    python bench/bench_sampler.py outputs/cpu-demo --adapter checkpoint-40 --samples 128 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import demo_data  # noqa: E402
import evaluation  # noqa: E402
import models  # noqa: E402
import rewards  # noqa: E402
import sandbox  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run's output_dir (its tiny-model/ or the adapters' own base)")
    parser.add_argument("--adapter", default="final", help="the adapter folder in it: final, best, checkpoint-N")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--games", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from transformers import GenerationConfig
    from trl import ModelConfig

    folder = args.run / args.adapter
    record = json.loads((folder / evaluation.RUN_FILE).read_text())
    settings = rewards.RewardSettings(**{k: record[k] for k in (*evaluation.BOARD, "profile")})
    base = models.trained_base(folder, json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"])
    model, tokenizer = models.load_model(base, ModelConfig(), adapter=str(folder))
    first = int((args.run / "training.log").read_text().split("held-out games (seeds ", 1)[1].split("-", 1)[0])
    seeds = list(range(first, first + args.games))
    budget = record["max_completion_length"]
    sampling = evaluation.sampling_options(**{k: record[k] for k in evaluation.SAMPLING})
    samplers = {
        "before (top_k unset: transformers' 50)": GenerationConfig(
            do_sample=True, temperature=sampling.temperature, max_new_tokens=budget,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id),
        "the run's own (TRL's)": evaluation.generation_config(sampling, tokenizer, budget),
    }  # fmt: skip
    sandbox.start()
    rows = {}
    try:
        for name, config in samplers.items():
            resolved, _ = model._prepare_generation_config(config)  # as generate resolves it
            texts = evaluation.sample_completions(model, tokenizer, settings, samples=args.samples, seed=seeds[0],
                                                  config=config, batch_size=16, chat_kwargs={})  # fmt: skip
            kinds = collections.Counter(demo_data.answer_kind(t) for t in texts)
            rows[name] = {"top_k": resolved.top_k, "top_p": resolved.top_p,
                          **evaluation.policy_metrics(texts, seeds, settings), "kinds": dict(kinds)}  # fmt: skip
    finally:
        sandbox.shutdown()
    print(f"{folder}: {args.samples} samples, {args.games} held-out games (seeds {seeds[0]}-{seeds[-1]})")
    print("| sampler | top_k | valid | mean score | mean reward | answers |\n|---|---:|---:|---:|---:|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['top_k']} | {r['valid_rate']:.1%} | {r['mean_score']:.1f} | {r['mean_reward']:.2f} | "
              f"{', '.join(f'{k} {v}' for k, v in sorted(r['kinds'].items()))} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
