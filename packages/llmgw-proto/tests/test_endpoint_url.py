"""parse_endpoint_url: the one strict rule for engine URLs, control plane and router (24.7)."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto.addr import EndpointURL, format_hostport, parse_endpoint_url


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://127.0.0.1:99999", "port 99999 is not in 1-65535"),
        ("http://127.0.0.1:0", "port 0 is not in 1-65535"),
        ("http://:8000", "no host"),
        ("http://", "no host"),
        ("http:///v1", "no host"),
        ("127.0.0.1:8000", "expected http://HOST:PORT"),
        ("ftp://h:21", "scheme 'ftp' is not http or https"),
        ("http://h:80a", "port '80a' is not a number"),
        ("http://h:", "port '' is not a number"),
        ("http://a..b:1", "empty label"),
        ("http://::1:8000", "bracket an IPv6 host"),
        ("http://[::1:8000", "IPv6"),
        ("http://[nope]:1", "not"),
        ("http://u:p@h:1", "user info"),
        ("http://h:1/?x=1", "query or fragment"),
        ("http://h:1\x1b[2J", "control characters"),
        ("http://h\t:1", "whitespace"),
        ("http://hé:1", "non-ASCII"),
        ("", "empty"),
    ],
)
def test_refused_with_the_url_and_why(url: str, why: str) -> None:
    with pytest.raises(ValueError, match="endpoint URL ") as err:
        parse_endpoint_url(url)
    assert repr(url) in str(err.value)
    assert why in str(err.value)


def test_accepted() -> None:
    assert parse_endpoint_url("http://10.0.0.1:20000") == EndpointURL("http", "10.0.0.1", 20000, "")
    assert parse_endpoint_url("https://gpu-a.internal") == EndpointURL(
        "https", "gpu-a.internal", 443, ""
    )
    assert parse_endpoint_url("http://[fd00::1]:8000/") == EndpointURL("http", "fd00::1", 8000, "/")
    assert parse_endpoint_url("http://h").port == 80
    assert str(parse_endpoint_url("http://[::1]:9")) == "http://[::1]:9"


hosts = st.one_of(
    st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?(\.[a-z0-9]{1,10}){0,3}", fullmatch=True),
    st.ip_addresses().map(str),
)


@given(st.sampled_from(["http", "https"]), hosts, st.integers(1, 65535))
def test_a_well_formed_url_round_trips(scheme: str, host: str, port: int) -> None:
    url = f"{scheme}://{format_hostport(host, port)}"
    parsed = parse_endpoint_url(url)
    assert parsed == EndpointURL(scheme, host, port, "")
    assert str(parsed) == url


def parsed_or_none(url: str) -> EndpointURL | None:
    try:
        return parse_endpoint_url(url)
    except ValueError as err:
        if not str(err).startswith("endpoint URL "):
            raise
        return None


@given(st.text(max_size=60))
def test_anything_is_refused_with_a_value_error_or_dialable(text: str) -> None:
    for url in (text, "http://" + text):
        parsed = parsed_or_none(url)
        if parsed is None:
            continue
        # What passes is what a router can dial: its own parse agrees and never raises.
        assert parsed.scheme in ("http", "https")
        assert parsed.host
        assert 1 <= parsed.port <= 65535
        parts = urlsplit(url)
        assert parts.hostname == parsed.host.lower()
        assert (parts.port or parsed.port) == parsed.port
        assert parsed.host.encode("idna")


@given(
    st.sampled_from(["http", "https"]), hosts, st.integers().filter(lambda p: not 1 <= p <= 65535)
)
def test_a_port_out_of_range_is_always_refused(scheme: str, host: str, port: int) -> None:
    with pytest.raises(ValueError, match="port"):
        parse_endpoint_url(f"{scheme}://{format_hostport(host, port)}")
