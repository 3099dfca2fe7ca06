"""Convert the gemma-3 270M GGUF into a Hugging Face folder that vLLM and SGLang load offline.

    python tools/gguf_to_hf.py GGUF OUTPUT_DIR

vLLM 0.32 on the CPU cannot load GGUF, and no small HF-format model ships on PyPI, so the test
suites build one from the GGUF that tests-real-engine already uses: bf16 safetensors, the
config, the tokenizer (keeping the GGUF's add_bos_token=true: without the BOS token the model
writes garbage) and a chat template (the GGUF has none). Runs in an environment with torch,
transformers and gguf (the vLLM venv nox builds). The output is byte-identical on every run;
a finished folder holds a STAMP naming its input, and a second run with the same input and
this same script leaves it alone.

transformers' save_pretrained refuses a model loaded from GGUF ("quantized with
QuantizationMethod.GGUF and is not serializable"), so the tensors are read through
transformers' GGUF reader and written here with safetensors.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# Bump when the output changes, so cached folders are rebuilt.
FORMAT = "1"

# Gemma's turn markup, written for this tool. The system message, if any, goes in front of
# the first user turn (Gemma has no system role); the model's turns are "model".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if role == 'user' -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def stamp_for(gguf: Path) -> str:
    return json.dumps(
        {"gguf_sha256": digest(gguf), "script_sha256": digest(Path(__file__)), "format": FORMAT}
    )


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # A weightless model only to map the GGUF's tensor names onto the HF ones.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.bfloat16
    )
    wanted = set(skeleton.state_dict())
    tied = bool(getattr(config, "tie_word_embeddings", False))
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in sorted(parsed["tensors"].items()):
        if key == "lm_head.weight" and tied:
            continue  # tied to the embeddings; safetensors refuses shared storage
        tensors[key] = tensor.to(torch.bfloat16).contiguous()
    missing = sorted(wanted - set(tensors) - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise SystemExit(f"gguf_to_hf: {gguf} lacks tensors the model needs: {missing}")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    conf = config.to_dict()
    conf["torch_dtype"] = "bfloat16"
    conf.pop("dtype", None)
    for where in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        conf.pop(where, None)  # the last two name the folder it was read from
    conf["architectures"] = [type(skeleton).__name__]
    write_json(out / "config.json", conf)
    # A chat turn ends with <end_of_turn>, not with <eos>; stop on both.
    generation = {"bos_token_id": config.bos_token_id, "pad_token_id": config.pad_token_id}
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    generation["eos_token_id"] = [config.eos_token_id, end_of_turn]
    write_json(out / "generation_config.json", generation)

    tokenizer.add_bos_token = True
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["add_bos_token"] = True
    tokenizer_config["add_eos_token"] = False
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    for where in ("is_local", "local_files_only", "_name_or_path"):
        tokenizer_config.pop(where, None)
    write_json(out / "tokenizer_config.json", tokenizer_config)
    (out / "chat_template.jinja").unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    gguf, out = Path(argv[0]), Path(argv[1])
    if not gguf.is_file():
        print(f"gguf_to_hf: no GGUF file at {gguf}", file=sys.stderr)
        return 2
    stamp = stamp_for(gguf)
    if (out / "STAMP").is_file() and (out / "STAMP").read_text() == stamp:
        print(f"gguf_to_hf: {out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        convert(gguf, work)
        (work / "STAMP").write_text(stamp)
        for path in work.iterdir():
            path.chmod(0o644)  # safetensors writes its file private
        work.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"gguf_to_hf: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
