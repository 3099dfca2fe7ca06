"""Make a small LoRA adapter for a Hugging Face causal LM folder, offline (issue 30).

    .cache/engines/vllm-0.32.0/bin/python tools/make_lora.py \\
        --model .cache/models/gemma3-270m-hf --out .cache/models/gemma3-270m-lora-a --seed 1

Writes what PEFT writes for a LoRA (``adapter_config.json``, ``adapter_model.safetensors``
with ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``), which vLLM's
``/v1/load_lora_adapter`` and SGLang's ``/load_lora_adapter`` read. The weights are random
and non-zero (PEFT starts B at zero, which would change nothing), seeded, so two seeds make
two adapters whose answers differ from each other's and from the base model's.
``--check`` loads the base model with transformers, adds the adapter's deltas and shows the
greedy continuation of a prompt with and without them (it exits 1 if they are the same).

It needs torch and safetensors (and transformers for --check): the vLLM venv has them. No
PEFT: the format is a config and a tensor file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TARGETS = ("q_proj", "v_proj")


def shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) of each target projection, from the model's config.json."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or hidden // heads)
    return {"q_proj": (heads * head_dim, hidden), "v_proj": (kv_heads * head_dim, hidden)}


def make(model: Path, out: Path, *, rank: int, alpha: int, seed: int, std: float) -> Path:
    import torch
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, Any] = {}
    for layer in range(layers):
        for name, (rows, cols) in shapes(config).items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            a = torch.randn(rank, cols, generator=gen) * std
            b = torch.randn(rows, rank, generator=gen) * std
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "base_model_name_or_path": str(model),
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out


def check(model: Path, adapter: Path, prompt: str, tokens: int) -> tuple[str, str]:
    """The greedy continuation of ``prompt`` by the base model and with the adapter."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    ids = tokenizer(prompt, return_tensors="pt").input_ids

    def greedy() -> str:
        with torch.no_grad():
            out = lm.generate(ids, max_new_tokens=tokens, do_sample=False)
        return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))

    base = greedy()
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    modules = dict(lm.named_modules())
    with torch.no_grad():
        for key, a in weights.items():
            if not key.endswith(".lora_A.weight"):
                continue
            stem = key[: -len(".lora_A.weight")]
            b = weights[stem + ".lora_B.weight"]
            target = modules[stem.removeprefix("base_model.model.")]
            target.weight += scale * (b.float() @ a.float())
    return base, greedy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the base model's HF folder")
    parser.add_argument("--out", type=Path, required=True, help="the adapter's folder")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--std", type=float, default=0.05, help="of A's and B's entries")
    parser.add_argument("--check", action="store_true", help="compare greedy answers")
    parser.add_argument("--prompt", default="The capital of France is")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there")
    if args.rank < 1 or args.alpha < 1:
        parser.error("--rank and --alpha must be >= 1")
    out = make(args.model, args.out, rank=args.rank, alpha=args.alpha, seed=args.seed, std=args.std)
    print(f"wrote {out}/adapter_config.json and adapter_model.safetensors")
    if args.check:
        base, tuned = check(args.model, out, args.prompt, 12)
        print(f"base:    {base!r}\nadapter: {tuned!r}")
        if base == tuned:
            print("the adapter does not change the answer: raise --std", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
