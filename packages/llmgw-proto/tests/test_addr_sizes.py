"""The one HOST:PORT grammar and the one size grammar every program uses."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto.addr import HostPort, bracket, format_hostport, parse_hostport
from llmgw_proto.sizes import parse_size

hosts = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(str),
    st.from_regex(r"\A[a-z][a-z0-9-]{0,20}(\.[a-z][a-z0-9-]{0,10}){0,3}\Z"),
)


@given(host=hosts, port=st.integers(1, 65535))
def test_format_then_parse_gives_the_same_address(host: str, port: int) -> None:
    assert parse_hostport(format_hostport(host, port)) == HostPort(host, port)


@given(host=st.ip_addresses(v=6).map(str), port=st.integers(1, 65535))
def test_ipv6_is_bracketed_exactly_once(host: str, port: int) -> None:
    text = str(HostPort(host, port))
    assert text == f"[{host}]:{port}"
    assert bracket(bracket(host)) == f"[{host}]"
    assert ipaddress.ip_address(parse_hostport(text).host)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("localhost", "no port"),
        ("localhost:http", "not a number"),
        ("localhost:0", "not in 1-65535"),
        ("localhost:70000", "not in 1-65535"),
        ("::1:7070", "write an IPv6 host as [::1]"),
        ("[::1:7070", "unclosed"),
        ("[::1]7070", "no port after"),
        (":7070", "no host"),
    ],
)
def test_bad_addresses_say_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match="expected") as err:
        parse_hostport(text)
    assert why in str(err.value)
    assert repr(text) in str(err.value)


def test_an_empty_host_takes_the_default_when_given() -> None:
    assert parse_hostport(":7070", default_host="0.0.0.0") == HostPort("0.0.0.0", 7070)
    assert parse_hostport("h:0", allow_port_zero=True).port == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80G", 80 * 1000**3),
        ("80GB", 80 * 1000**3),
        ("80gb", 80 * 1000**3),
        ("80Gi", 80 * 1024**3),
        ("80GiB", 80 * 1024**3),
        ("141GB", 141 * 1000**3),
        ("512M", 512 * 1000**2),
        ("512MiB", 512 * 1024**2),
        ("1.5Ti", int(1.5 * 1024**4)),
        ("1024", 1024),
        (" 8 KiB ", 8192),
        (4096, 4096),
    ],
)
def test_sizes(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["80 gigs", "G", "-1G", "", True, -5, None, "80Xi"])
def test_bad_sizes_say_what_was_given(bad: object) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


@given(n=st.integers(0, 10**6), unit=st.sampled_from(["k", "M", "G", "T"]))
def test_binary_units_are_larger_than_decimal_ones(n: int, unit: str) -> None:
    assert parse_size(f"{n}{unit}i") >= parse_size(f"{n}{unit}")
    assert parse_size(f"{n}{unit}iB") == parse_size(f"{n}{unit}i")
