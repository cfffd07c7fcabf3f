"""Credentials as each vendor's client presents them (gateway.auth.presented_credential)."""

from __future__ import annotations

import pytest

from gateway.auth import presented_credential


@pytest.mark.parametrize(
    ("headers", "query", "expected"),
    [
        ({"authorization": "Bearer ck_a_1"}, None, "ck_a_1"),  # OpenAI, Cartesia SDK 4
        ({"authorization": "Api-Key ck_a_2"}, None, "ck_a_2"),  # Baseten
        ({"authorization": "token ck_a_3"}, None, "ck_a_3"),
        ({"xi-api-key": "ck_a_4"}, None, "ck_a_4"),  # ElevenLabs
        ({"x-api-key": " ck_a_5 "}, None, "ck_a_5"),  # Cartesia
        ({}, "api_key=ck_a_6&cartesia_version=2025-04-16", "ck_a_6"),
        ({}, "access_token=tok.sig", "tok.sig"),
        ({}, "token=tok.sig2", "tok.sig2"),
        ({"authorization": "Basic dXNlcg=="}, None, None),  # not a scheme Cadence takes
        ({}, None, None),
        ({}, "cartesia_version=2025-04-16", None),
    ],
)
def test_presented_credential(headers: dict[str, str], query: str | None, expected: str | None) -> None:
    assert presented_credential(headers, query) == expected


def test_a_header_wins_over_the_query_and_rest_reads_no_query() -> None:
    assert presented_credential({"x-api-key": "ck_h_1"}, "api_key=ck_q_1") == "ck_h_1"
    assert presented_credential({}, None) is None  # HTTP requests pass no query: keys never in URLs
