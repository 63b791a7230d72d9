"""How far the NF4 model a default run trains is from the 16-bit original its adapters are merged into, on the CPU.

    .venv/bin/python bench/nf4_gap.py            # a tiny GPT-OSS (tests/test_merge.py's), seeds 0-2

The default preset trains LoRA on Unsloth's NF4 checkpoint and merge_2048.py merges it into the BF16 original: the
merged model is the original plus the adapters, not the model that was trained. This measures the gap. A tiny GPT-OSS
in bf16 (random weights, PyTorch's initializer, std 0.02); every weight Unsloth's 4-bit checkpoint quantizes (attention
q/k/v/o, each expert's Linear as Unsloth splits them; the router, embedding, output layer, norms, biases and sinks stay
16-bit: bench/gpu_check.py's quantize_split) goes through bitsandbytes' own NF4 round trip on the CPU (quantize_4bit /
dequantize_4bit, block 64, double quantization), which is the weight Unsloth's NF4 matmul uses. Both models then run in
float32 arithmetic on the training prompt and two sampled completions, and the next-token distributions are compared
(mean KL per token, the top token's agreement); beside it, the same for the BF16 model with LoRA adapters that change
each weight by 0.2% and by 10% of a weight's RMS (bench/gpu_check.py's move_adapters), the adapters' own effect.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def nf4_round_trip(weight):
    """The weight bitsandbytes' NF4 holds for `weight` (out, in): quantized in blocks of 64 along its rows."""
    import bitsandbytes.functional as bnb
    import torch

    quantized, state = bnb.quantize_4bit(weight.to(torch.bfloat16).contiguous(), blocksize=64, quant_type="nf4",
                                         compress_statistics=True)  # fmt: skip
    return bnb.dequantize_4bit(quantized, state).to(weight.dtype)


def quantize_like_unsloth(model) -> float:
    """Every weight Unsloth's split 4-bit checkpoint holds in NF4, replaced by its round trip; returns the error's RMS
    over the weights' RMS."""
    import torch

    error = norm = 0.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            owner, _, leaf = name.rpartition(".")
            if owner.rpartition(".")[2] in ("q_proj", "k_proj", "v_proj", "o_proj") and leaf == "weight":
                new = nf4_round_trip(param.data)
            elif owner.endswith("mlp.experts") and leaf in ("gate_up_proj", "down_proj"):
                # fused (experts, in, out): Unsloth's Linear per expert holds each slice transposed, (out, in)
                new = torch.stack([nf4_round_trip(slice_.t()).t() for slice_ in param.data])
            else:
                continue
            error += float((new.float() - param.data.float()).pow(2).sum())
            norm += float(param.data.float().pow(2).sum())
            param.data.copy_(new)
    return (error / norm) ** 0.5


def tiny_gpt_oss(seed: int):
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    import demo_data
    import rewards

    tokenizer = demo_data.build_tokenizer([rewards.build_prompt(rewards.RewardSettings())])
    config = GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], router_aux_loss_coef=0.0, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    return GptOssForCausalLM(config).to(torch.bfloat16), tokenizer


def gap(seed: int) -> dict:
    import copy

    import gpu_check
    import torch
    from peft import LoraConfig, get_peft_model

    import merging
    import models

    bf16, tokenizer = tiny_gpt_oss(seed)
    nf4 = copy.deepcopy(bf16)
    weight_error = quantize_like_unsloth(nf4)
    reference = copy.deepcopy(bf16).float().eval()
    inputs = merging.evaluation_prompt(tokenizer)
    start = inputs["input_ids"].shape[1]
    sequences = [inputs["input_ids"][0].tolist() + c for c in models.seeded_samples(reference, tokenizer, inputs, seed, size=2)]
    base = merging._logprobs(reference, sequences, start)
    figures = {"seed": seed, "weight_error": weight_error, "positions": sum(len(s) - start for s in sequences)}

    def compare(model, label):
        got = merging._logprobs(model.float().eval(), sequences, start)
        figures[f"{label}_kl"] = merging.mean_kl(base, got)
        same = sum(int((p.argmax(-1) == q.argmax(-1)).sum()) for p, q in zip(base, got))
        figures[f"{label}_top1"] = same / figures["positions"]

    compare(nf4, "nf4")
    for share in (0.002, 0.1):
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          target_parameters=models.GPT_OSS_EXPERTS)  # fmt: skip
        adapted = get_peft_model(copy.deepcopy(bf16).float(), lora)
        gpu_check.move_adapters(adapted, share=share)
        with torch.no_grad():
            compare(adapted, f"adapters_{share:g}")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="tiny models built with seeds 0..N-1")
    args = parser.parse_args()
    import models

    models.quiet_library_imports()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    for seed in range(args.seeds):
        f = gap(seed)
        print(f"seed {seed}: NF4 weight error {f['weight_error']:.3f} of the weights' RMS; over {f['positions']} "
              f"positions, KL(bf16 || nf4) {f['nf4_kl']:.3g} nats/token (top token {f['nf4_top1']:.0%} the same); "
              f"adapters' own effect at 0.2% {f['adapters_0.002_kl']:.3g} (top {f['adapters_0.002_top1']:.0%}), "
              f"at 10% {f['adapters_0.1_kl']:.3g} (top {f['adapters_0.1_top1']:.0%})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
