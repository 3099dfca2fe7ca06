"""SGLang's ``--config FILE.yaml``, where the agent puts the engine's API key (issue 24):
the file's options come before the command line's, which win; its refusals name what
is wrong, as SGLang's server_args_config_parser does."""

from __future__ import annotations

from pathlib import Path

import pytest
from llmgw_sim.flags import parse_engine_args


def test_the_options_file_gives_the_key(tmp_path: Path) -> None:
    options = tmp_path / "s.options.yaml"
    options.write_text('api-key: "k\\u007fey"\ncontext-length: 4096\nenable-metrics: true\n')
    ns = parse_engine_args("sglang", ["--model-path", "m", "--config", str(options)])
    assert ns.api_key == "k\x7fey"
    assert ns.context_length == 4096
    assert ns.enable_metrics is True
    # The command line wins over the file.
    ns = parse_engine_args(
        "sglang", ["--config", str(options), "--model-path", "m", "--context-length", "8192"]
    )
    assert (ns.api_key, ns.context_length) == ("k\x7fey", 8192)


@pytest.mark.parametrize(
    ("name", "text", "args", "message"),
    [
        ("o.json", "{}", None, "Config file must be YAML format, got: .json"),
        ("o.yaml", "- a\n", None, "Config file must contain a dictionary at root level"),
        ("o.yaml", "{}", ["--config"], "No config file specified after --config flag!"),
        ("o.yaml", "{}", ["--config", "a.yaml", "--config"], "Multiple config files"),
        ("missing.yaml", None, None, "Config file not found"),
    ],
)
def test_a_bad_options_file_is_refused_by_name(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    text: str | None,
    args: list[str] | None,
    message: str,
) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    argv = ["--model-path", "m", *(args if args is not None else ["--config", str(path)])]
    with pytest.raises(SystemExit) as exit_:
        parse_engine_args("sglang", argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
