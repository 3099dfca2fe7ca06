from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto.config import BaseConfig, ConfigError, Duration, load, parse_duration


class Profile(BaseConfig):
    gpus_per_node: Annotated[int, msgspec.Meta(ge=1)] = 1
    load_timeout: Duration = Duration(600)


class Model(BaseConfig):
    name: str
    profiles: dict[str, Profile]


class Config(BaseConfig):
    models: list[Model] = []
    interval: Duration = Duration(5)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load(path, Config)
    return str(info.value)


def test_yaml_and_toml_load_the_same(tmp_path: Path) -> None:
    yaml_path = write(
        tmp_path,
        "c.yaml",
        "interval: 500ms\nmodels:\n  - name: m\n    profiles:\n      fast: {gpus_per_node: 2}\n",
    )
    toml_path = write(
        tmp_path,
        "c.toml",
        'interval = "500ms"\n[[models]]\nname = "m"\n[models.profiles.fast]\ngpus_per_node = 2\n',
    )
    assert load(yaml_path, Config) == load(toml_path, Config)
    assert load(yaml_path, Config).interval == 0.5


def test_error_names_file_and_field_with_dict_keys(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "control.yaml",
        "models:\n  - name: m\n    profiles:\n      slow: {}\n      fast: {gpus_per_node: 0}\n",
    )
    assert error_of(path) == (
        f"{path}: $.models[0].profiles.fast.gpus_per_node: Expected `int` >= 1"
    )


def test_unknown_field_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", "models: []\nintervall: 5s\n")
    assert error_of(path) == (
        f"{path}: $: Object contains unknown field `intervall`: did you mean `interval`?"
    )


def test_unknown_field_inside_a_dict_value_suggests_the_nearest(tmp_path: Path) -> None:
    path = write(
        tmp_path, "c.yaml", "models:\n  - name: m\n    profiles:\n      fast: {gpus_per_nod: 2}\n"
    )
    assert error_of(path) == (
        f"{path}: $.models[0].profiles.fast: Object contains unknown field `gpus_per_nod`: "
        "did you mean `gpus_per_node`?"
    )


def test_unknown_field_far_from_any_lists_the_known_ones(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", "models:\n  - name: m\n    profiles: {}\n    zzz: 1\n")
    assert error_of(path).endswith("unknown field `zzz`: known fields are name, profiles")


class Engine(enum.Enum):
    VLLM = "vllm"
    SGLANG = "sglang"


class WithEnum(BaseConfig):
    engine: Engine = Engine.VLLM
    mode: Literal["fast", "slow"] = "fast"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("engine: vLLM\n", "$.engine: Invalid enum value 'vLLM': expected one of 'vllm', 'sglang'"),
        ("mode: quick\n", "$.mode: Invalid enum value 'quick': expected one of 'fast', 'slow'"),
    ],
)
def test_a_bad_enum_value_lists_the_valid_ones(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, "c.yaml", text)
    with pytest.raises(ConfigError) as info:
        load(path, WithEnum)
    assert str(info.value) == f"{path}: {expected}"


def test_wrong_type_and_bad_duration(tmp_path: Path) -> None:
    assert error_of(write(tmp_path, "a.yaml", "models: 3\n")).endswith(
        "$.models: Expected `array`, got `int`"
    )
    assert error_of(write(tmp_path, "b.yaml", "interval: soon\n")).endswith(
        "$.interval: Expected a duration like `5s`, `500ms` or `2m`, got 'soon'"
    )


def test_syntax_errors_and_unknown_formats(tmp_path: Path) -> None:
    assert "line 2, column 8: invalid YAML" in error_of(
        write(tmp_path, "a.yaml", "a: 1\nb: [1, }\n")
    )
    assert "invalid TOML" in error_of(write(tmp_path, "a.toml", "models = [\n"))
    assert "unknown config format '.json'" in error_of(write(tmp_path, "a.json", "{}"))
    assert "cannot read" in error_of(tmp_path / "missing.yaml")


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    assert load(write(tmp_path, "empty.yaml", ""), Config) == Config()


@given(st.floats(0, 10**6, allow_nan=False), st.sampled_from(["ms", "s", "m", "h", ""]))
def test_durations_scale_by_unit(number: float, unit: str) -> None:
    text = f"{number:.3f}{unit}"
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "": 1}[unit]
    assert parse_duration(text) == pytest.approx(float(f"{number:.3f}") * scale)


@pytest.mark.parametrize("bad", ["-1s", "5 days", "", True, -3, [1]])
def test_bad_durations(bad: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


class Range(BaseConfig):
    min: int
    max: int


class Scaled(BaseConfig):
    replicas: Annotated[int, msgspec.Meta(ge=0)] | Range = 1


def test_a_number_or_object_field_names_the_object_fields(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", "replicas: two\n")
    with pytest.raises(ConfigError) as info:
        load(path, Scaled)
    assert str(info.value) == (
        f"{path}: $.replicas: Expected `int | object`, got `str` "
        "(the object form has the fields min, max)"
    )
