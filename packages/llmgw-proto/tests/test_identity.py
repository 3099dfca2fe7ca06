"""read_identity: who a verified certificate's subject says it is, or why it says nothing.

The dicts are shaped as ``ssl.SSLSocket.getpeercert()`` returns them: the subject is a
tuple of relative distinguished names, each a tuple of (attribute, value) pairs.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto.tls import ROLES, PeerIdentity, UnreadableIdentity, peer_identity, read_identity

CN, OU, ORG = "commonName", "organizationalUnitName", "organizationName"


def cert(*pairs: tuple[str, str], uris: tuple[str, ...] = ()) -> dict[str, object]:
    out: dict[str, object] = {"subject": tuple(((a, v),) for a, v in pairs)}
    if uris:
        out["subjectAltName"] = tuple(("URI", u) for u in uris)
    return out


def test_a_well_formed_certificate_reads() -> None:
    got = read_identity(cert((ORG, "llmgw"), (OU, "node"), (CN, "gpu-a")))
    assert got == PeerIdentity(role="node", name="gpu-a")


@pytest.mark.parametrize(
    ("subject", "why"),
    [
        ([(ORG, "llmgw"), (OU, "node")], "no common name"),
        ([(ORG, "llmgw"), (CN, "gpu-a")], "no organizational unit"),
        ([(OU, "node"), (CN, "gpu-a"), (CN, "gpu-b")], "2 common names"),
        ([(OU, "node"), (OU, "router"), (CN, "gpu-a")], "2 organizational units"),
        ([(OU, "node"), (OU, "node"), (CN, "gpu-a")], "2 organizational units"),
        ([(OU, "operator"), (CN, "gpu-a")], "is not node, router, server or admin"),
        ([(OU, "node"), (CN, "")], "an empty common name"),
        ([(OU, "node"), (CN, "  ")], "an empty common name"),
        ([(OU, "node"), (CN, " gpu-a")], "is not a valid name"),
        ([(OU, "node"), (CN, "gpu\x00a")], "is not a valid name"),
        ([(OU, "node"), (CN, "g" * 300)], "is not a valid name"),
        ([], "no common name"),
    ],
)
def test_unreadable_subjects_say_why(subject: list[tuple[str, str]], why: str) -> None:
    with pytest.raises(UnreadableIdentity, match=why):
        read_identity(cert(*subject))
    assert peer_identity(cert(*subject)) is None


def test_no_certificate_is_unreadable() -> None:
    nothings: tuple[dict[str, object] | None, ...] = (None, {})
    for nothing in nothings:
        with pytest.raises(UnreadableIdentity, match="no certificate subject"):
            read_identity(nothing)


def test_a_san_only_spiffe_certificate_is_refused_naming_its_uri() -> None:
    spiffe = cert((ORG, "llmgw"), uris=("spiffe://llmgw/node/gpu-a",))
    with pytest.raises(UnreadableIdentity, match="spiffe://llmgw/node/gpu-a"):
        read_identity(spiffe)
    # With the CN/OU rules met, the URI SAN changes nothing.
    both = cert((OU, "node"), (CN, "gpu-a"), uris=("spiffe://llmgw/node/gpu-b",))
    assert read_identity(both) == PeerIdentity("node", "gpu-a")


def test_a_multi_valued_rdn_counts_every_value() -> None:
    odd: dict[str, object] = {"subject": (((OU, "node"), (CN, "gpu-a"), (CN, "gpu-b")),)}
    with pytest.raises(UnreadableIdentity, match="2 common names"):
        read_identity(odd)


names = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=60
)
attributes = st.sampled_from([CN, OU, ORG, "countryName", "localityName"])
values = st.one_of(names, st.sampled_from(ROLES), st.just(""), st.just(" "))


@given(st.lists(st.tuples(attributes, values), max_size=6))
def test_readable_exactly_when_one_valid_cn_and_one_known_ou(
    subject: list[tuple[str, str]],
) -> None:
    cns = [v for a, v in subject if a == CN]
    ous = [v for a, v in subject if a == OU]
    readable = (
        len(cns) == 1
        and cns[0].strip() == cns[0] != ""
        and cns[0].isprintable()
        and len(ous) == 1
        and ous[0] in ROLES
    )
    if readable:
        assert read_identity(cert(*subject)) == PeerIdentity(role=ous[0], name=cns[0])
    else:
        with pytest.raises(UnreadableIdentity, match=r"\w"):
            read_identity(cert(*subject))
