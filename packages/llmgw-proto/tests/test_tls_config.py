"""The one tls: section and its rule: cert, key and ca required and present unless insecure."""

from __future__ import annotations

from pathlib import Path

import pytest
from llmgw_proto.config import ConfigError
from llmgw_proto.tls import TlsConfig


def test_insecure_needs_no_files() -> None:
    TlsConfig(insecure=True).check("a.yaml", "$.control.tls")


def test_the_flag_turns_plaintext_on_never_off() -> None:
    assert TlsConfig().with_insecure_flag(True).insecure
    assert TlsConfig(insecure=True).with_insecure_flag(False).insecure
    assert not TlsConfig().with_insecure_flag(False).insecure


def test_a_missing_setting_names_the_field() -> None:
    with pytest.raises(ConfigError) as err:
        TlsConfig(cert="a", key="b").check("router.yaml", "$.control.tls")
    assert str(err.value).startswith("router.yaml: $.control.tls.")
    assert err.value.field == "$.control.tls.cert" or "required" in err.value.message


def test_a_missing_file_names_the_field_and_the_path(tmp_path: Path) -> None:
    cert = tmp_path / "n.crt"
    cert.write_text("x")
    (tmp_path / "ca.crt").write_text("x")
    tls = TlsConfig(cert=str(cert), key=str(tmp_path / "n.key"), ca=str(tmp_path / "ca.crt"))
    with pytest.raises(ConfigError) as err:
        tls.check("agent.yaml", "$.control.tls")
    assert err.value.source == "agent.yaml"
    assert err.value.field == "$.control.tls.key"
    assert err.value.message == f"no such file: {tmp_path / 'n.key'}"


def test_a_directory_is_not_a_certificate(tmp_path: Path) -> None:
    tls = TlsConfig(cert=str(tmp_path), key=str(tmp_path), ca=str(tmp_path))
    with pytest.raises(ConfigError, match="is a directory"):
        tls.check("control.yaml", "$.tls")
