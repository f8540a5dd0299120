"""The secrets policy (jupyter_themisto.redaction): names, records, sources, export rows."""

from __future__ import annotations

import pytest

from jupyter_themisto.redaction import (
    REDACTED,
    is_secret_name,
    redact_export_row,
    redact_source,
    redact_text,
    redact_variable,
)


@pytest.mark.parametrize(
    "name", ["api_key", "GITHUB_TOKEN", "db_Password", "passwd", "aws_secret", "Credentials"]
)
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["df", "model", "result", "pass_rate", "X_train"])
def test_plain_names(name):
    assert not is_secret_name(name)


def test_custom_pattern_and_bad_pattern():
    assert is_secret_name("my_pin", r"pin\b")
    assert not is_secret_name("api_key", r"pin\b")
    with pytest.raises(ValueError, match="invalid secret pattern"):
        is_secret_name("x", "(unclosed")


def test_redact_variable_drops_value_repr_and_fingerprint():
    record = {
        "name": "openai_api_key",
        "type": "str",
        "size": 60,
        "summary": {"len": 51, "repr": "'sk-abc'"},
        "blob_hash": "ab" * 32,
        "fingerprint": "str:123",
    }
    out = redact_variable(record)
    assert out["name"] == "openai_api_key" and out["type"] == "str"
    assert out["summary"] == {"redacted": True}
    assert out["blob_hash"] is None and out["fingerprint"] is None and out["size"] is None
    assert out["stub_reason"].startswith("redacted")
    plain = {"name": "df", "type": "pandas.DataFrame", "summary": {"repr": "x"}}
    assert redact_variable(plain) == plain


def test_redact_source_literals():
    src = (
        'API_KEY = "sk-live-123"\n'
        "token: str = 'tok-456'\n"
        'conf = {"password": "pw-789", "user": "ann"}\n'
        'client = Client(api_key="sk-000", timeout=3)\n'
        'name = "keep me"\n'
    )
    out = redact_source(src)
    for leaked in ("sk-live-123", "tok-456", "pw-789", "sk-000"):
        assert leaked not in out
    assert f'API_KEY = "{REDACTED}"' in out
    assert '"user": "ann"' in out and 'name = "keep me"' in out and "timeout=3" in out


def test_redact_text_and_export_row():
    assert redact_text("the token is abcdef123", ["abcdef123"]) == f"the token is {REDACTED}"
    # Very short values are not scrubbed (they would erase ordinary text).
    assert redact_text("a 1 b", ["1"]) == "a 1 b"
    row = {
        "source": 'secret = "xyz-very-secret"',
        "variables": [{"name": "secret", "type": "str", "summary": {"repr": "'xyz'"}}],
    }
    out = redact_export_row(row)
    assert "xyz-very-secret" not in out["source"]
    assert out["variables"][0]["summary"] == {"redacted": True}
    assert row["source"] == 'secret = "xyz-very-secret"'  # the input is not mutated
