"""--tokenizer: the simulator renders and encodes with llmgw_proto.prompts alone, without
llmgw-router installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from llmgw_testkit.tokenizer import write_word_tokenizer


def test_the_tokenizer_loads_and_encodes_without_the_router(tmp_path: Path) -> None:
    folder = write_word_tokenizer(tmp_path / "t", ["hello", "there"])
    # A None entry in sys.modules makes any import of llmgw_router fail, as if not installed.
    code = (
        "import sys\n"
        "sys.modules['llmgw_router'] = None\n"
        "from llmgw_sim.engine import _load_tokenizer\n"
        f"tok = _load_tokenizer({str(folder)!r})\n"
        "print(list(tok.chat([{'role': 'user', 'content': 'hello there'}])))\n"
        "print(list(tok.completion('hello')))\n"
        "print(sorted(m for m, v in sys.modules.items() if m.startswith('llmgw_router') and v))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    # <s> <|user|> hello there <|assistant|>; <s> hello (the word tokenizer's ids).
    assert out.stdout.splitlines() == ["[0, 3, 5, 6, 4]", "[0, 5]", "[]"]
