"""The secrets policy (jupyter_themisto.redaction): names, literals, credential shapes, values
followed in the kernel, keyed hashes in the store, what the server and exports scrub."""

from __future__ import annotations

import html
import json
import multiprocessing
import os
import pickle
import stat
from pathlib import Path

import markupsafe
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jupyter_themisto.redaction import (
    MIN_SECRET_VALUE_LEN,
    REDACTED,
    SECRET_VALUE_REASON,
    DigestMatcher,
    KernelSecrets,
    StoreRedactor,
    is_secret_name,
    key_path,
    load_key,
    pickle_strings,
    redact_export_row,
    redact_literals,
    redact_source,
    redact_text,
    redact_tokens,
    redact_variable,
    secret_digest,
)
from jupyter_themisto.store import TrajectoryStore


@pytest.mark.parametrize(
    "name",
    [
        "api_key",
        "GITHUB_TOKEN",
        "db_Password",
        "passwd",
        "aws_secret",
        "Credentials",
        "OPENAI_API_KEY",
        "x-api-key",
        "apiKey",
        "accessToken",
        "hf_token",
        "AWS_SECRET_ACCESS_KEY",
        "my_passphrase",
    ],
)
def test_secret_names(name):
    assert is_secret_name(name)


# Names real notebooks use for ordinary values (a loop's `key`, a sort key, NLP tokens): their
# values must not be followed, or "sepal_length" would be scrubbed from every cell.
@pytest.mark.parametrize(
    "name",
    [
        "df",
        "model",
        "result",
        "pass_rate",
        "X_train",
        "key",
        "keys",
        "sort_key",
        "primary_key",
        "keywords",
        "monkey",
        "tokens",
        "tokenizer",
        "bos_token",
        "max_tokens",
    ],
)
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
        "auth_token: str = 'tok-456'\n"
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


# -- literals bound to secret names, credential shapes ----------------------------------------


@pytest.mark.parametrize(
    "code, value",
    [
        ('os.environ["OPENAI_API_KEY"] = "envval-123456"', "envval-123456"),
        ("os.environ['DB_PASSWORD']='envval-234567'", "envval-234567"),
        ('os.putenv("GITHUB_TOKEN", "envval-345678")', "envval-345678"),
        ('os.environ.setdefault("API_TOKEN", "envval-456789")', "envval-456789"),
        ('os.environ.update({"MY_SECRET": "envval-567890"})', "envval-567890"),
        ('os.environ.update(SERVICE_KEY="envval-678901")', "envval-678901"),
        ("%env HF_TOKEN=envval-789012", "envval-789012"),
        ("!export AWS_SECRET_ACCESS_KEY='envval-890123'", "envval-890123"),
        ('if (api_key := "envval-901234"):\n    pass', "envval-901234"),
        ("pw = {'password': 'envval-012345', 'user': 'ann'}", "envval-012345"),
        (
            'conf = """\napi_key = "inner-123456"\n"""\nauth_token = """multi\nline-secret"""',
            "line-secret",
        ),
    ],
)
def test_redact_literals_bound_to_secret_names(code, value):
    found: list[str] = []
    out = redact_literals(code, found=found)
    assert value not in out and REDACTED in out
    assert any(value in f for f in found)


@pytest.mark.parametrize(
    "code, kept",
    [
        ('user, db_password = "bob", "unpack-123456"', '"bob"'),
        ('(user, api_key) = ("bob", "unpack-123456")', '"bob"'),
        ('api_key, user = "unpack-123456", "bob"', '"bob"'),
        ("def connect():\n    user, password = 'bob', 'unpack-123456'\n    return 1", "'bob'"),
        ('[cfg.user, cfg.password] = ["bob", "unpack-123456"]', '"bob"'),
        ('user, passwort, password = "bob", 7, b"unpack-123456"', '"bob", 7, b"'),
        ('n = "é"\nuser, api_key = "bé", "unpack-123456"  # ünïcode before', '"bé"'),
    ],
)
def test_redact_literals_unpacked_into_secret_names(code, kept):
    """Tuple unpacking: the literal at the secret name's place is scrubbed, not the one after
    the last target (`user, password = "bob", "…"` kept "bob" and the secret once)."""
    found: list[str] = []
    out = redact_literals(code, found=found)
    assert "unpack-123456" not in out and REDACTED in out and kept in out
    assert found == ["unpack-123456"]


def test_redact_literals_keeps_comparisons_and_other_names():
    code = 'if token == "abcdef-123456":\n    name = "keep-this-value"\nprint("a", "b")'
    assert redact_literals(code) == code


@pytest.mark.parametrize(
    "token",
    [
        "sk-proj-AbCdEf0123456789AbCdEf0123456789",
        "sk-ant-api03-AbCdEf0123456789AbCdEf0123456789",
        "ghp_" + "a1B2" * 9,
        "github_pat_" + "A1b2_" * 8,
        "AKIA" + "ABCDEFGHIJ234567",
        "xoxb-123456789012-abcdefABCDEF",
        "AIza" + "B" * 35,
        "hf_" + "x1Y2" * 9,
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
        "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA\nabc\n-----END RSA PRIVATE KEY-----",
    ],
)
def test_credential_shapes_anywhere(token):
    for text in (f"x = {token!r}", f"print({token!r})\n{token}", repr({"v": token})):
        found: list[str] = []
        out = redact_tokens(text, found)
        assert token not in out and REDACTED in out
        assert found


def test_credential_shapes_leave_ordinary_text():
    text = "task-management risk-adjusted ask-me-anything-please AKIAxyz sk-short"
    assert redact_tokens(text) == text


# -- values the kernel knows --------------------------------------------------------------------


SECRET = "hunter2-planted-value-0001"


def test_environment_variables_named_by_convention_are_followed(monkeypatch):
    """Database clients read `MYSQL_PWD`, `PGPASSWORD`, `DB_PASS`: the values are followed; the
    shell's `PWD`/`OLDPWD` (a folder) and a variable that only begins with "pass" are not."""
    secret = {
        "MYSQL_PWD": "mysql-planted-0101",
        "DB_PASS": "db-planted-0102",
        "SMTP-PASS": "smtp-planted-0103",
        "PGPASSWORD": "pg-planted-0104",
    }
    plain = {
        "PWD": "/home/ann/project",
        "OLDPWD": "/home/ann/other",
        "PASSENGERS": "titanic-csv",
        "BYPASS_CACHE": "always-on-0105",
    }
    for name, value in {**secret, **plain}.items():
        monkeypatch.setenv(name, value)
    ks = KernelSecrets()
    ks.observe({}, source="x = 1")
    assert set(secret.values()) <= ks.values
    assert not set(plain.values()) & ks.values
    # Set in a cell, too.
    code = 'os.environ["MYSQL_PWD"] = "cell-planted-0106"\n%env DB_PASS=cell-planted-0107'
    found: list[str] = []
    assert redact_literals(code, found=found).count(REDACTED) == 2
    assert {"cell-planted-0106", "cell-planted-0107"} <= set(found)
    assert (
        redact_literals('os.environ["PWD"] = "/tmp/work-dir"')
        == 'os.environ["PWD"] = "/tmp/work-dir"'
    )


def test_the_walk_through_nested_values_is_bounded_and_misses_no_later_secret():
    cycle = {"password": "cycle-planted-0021"}
    cycle["self"] = cycle
    ns = {
        "numbers": list(range(10**6)),  # one look: its first item holds no dict
        "records": [{"user": f"u{i}", "score": i} for i in range(10_000)],  # 8 looked at
        "cycle": cycle,
        "deep": {"a": {"b": {"c": {"d": {"e": {"secret": "deep-planted-0022"}}}}}},
        "zz_later": [({"api_key": "later-planted-0023"},)],
    }
    ks = KernelSecrets()
    ks.observe(ns, source="x = 1")
    assert {"cycle-planted-0021", "deep-planted-0022", "later-planted-0023"} <= ks.values
    assert not any(v.startswith("u") for v in ks.values)


def test_kernel_secrets_follow_values(monkeypatch):
    monkeypatch.setenv("PLANTED_SERVICE_TOKEN", "env-planted-value-0002")
    ks = KernelSecrets()
    ns = {
        "api_key": SECRET,
        "x": SECRET,
        "conf": {"db": {"password": "nested-planted-0003"}, "user": "ann-the-user"},
        "word": "ordinary",
        "_private_token": "never-looked-at-0004",
    }
    ks.observe(ns, source='client = connect(auth_token="literal-planted-0005")')
    for known in (SECRET, "env-planted-value-0002", "nested-planted-0003", "literal-planted-0005"):
        assert known in ks.values
    assert "ann-the-user" not in ks.values and "ordinary" not in ks.values
    assert "never-looked-at-0004" not in ks.values
    # Scrubbed wherever they appear, escaped forms included.
    text = f"{SECRET} {SECRET!r} {json.dumps({'v': 'nested-planted-0003'})}"
    assert ks.scrub(text).count(REDACTED) == 3
    # A displayed dict's secret is learnt from the output itself.
    shown = ks.scrub_output("{'password': 'shown-planted-0006', 'n': 1}")
    assert "shown-planted-0006" not in shown and "shown-planted-0006" in ks.values
    # Values holding a secret: strings, serialized bytes (utf-8, numpy's utf-32 and a person's
    # own utf-16 of either byte order), summaries.
    assert ks.stub_reason(SECRET) == SECRET_VALUE_REASON
    assert ks.stub_reason(f"prefix {SECRET} suffix") == SECRET_VALUE_REASON
    assert ks.stub_reason(data=pickle.dumps([1, {"k": SECRET}])) == SECRET_VALUE_REASON
    for encoding in ("utf-32-le", "utf-16", "utf-16-be"):
        held = pickle.dumps({"k": SECRET.encode(encoding)})
        assert ks.stub_reason(data=held) == SECRET_VALUE_REASON, encoding
    assert ks.stub_reason(summary={"repr": f"[{SECRET!r}]"}) == SECRET_VALUE_REASON
    assert ks.stub_reason("plain", data=pickle.dumps([1, 2]), summary={"repr": "[1, 2]"}) is None
    # Credential shapes make a stub with nothing learnt before.
    assert KernelSecrets().stub_reason("sk-proj-AbCdEf0123456789AbCdEf01") == SECRET_VALUE_REASON


def test_kernel_secrets_generation_counts_new_values_only():
    ks = KernelSecrets()
    assert ks.learn(SECRET) and ks.generation > 0
    g = ks.generation
    assert not ks.learn(SECRET) and not ks.learn("short") and not ks.learn(42)
    assert ks.generation == g
    assert ks.learn(SECRET + "\n") is True  # the newline form is new; the stripped one is not
    assert SECRET in ks.values


# -- the keyed hashes ---------------------------------------------------------------------------


def test_key_file_is_private_and_shared(tmp_path):
    store = tmp_path / "t.sqlite"
    assert load_key(store, create=False) is None
    key = load_key(store)
    assert len(key) == 32 and load_key(store) == key
    assert stat.S_IMODE(key_path(store).stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["t.sqlite.key"]  # no temporary left

    # Processes creating it at once agree on one key.
    other = tmp_path / "u.sqlite"
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        keys = pool.map(load_key, [other] * 8)
    assert len(set(keys)) == 1


def test_digest_matcher_finds_values_at_word_starts_only():
    key = b"k" * 32
    values = [SECRET, "pass phrase with spaces"]
    m = DigestMatcher(key, [(secret_digest(key, v), len(v), " " in v) for v in values])
    text = f'x = "{SECRET}"; y = {SECRET}; say("pass phrase with spaces")'
    assert m.find(text) == set(values)
    assert SECRET not in m.scrub(text) and "pass phrase" not in m.scrub(text)
    assert m.find("no secret here, hunter2-planted-value-0002") == set()
    # Another key finds nothing: the hashes alone confirm no guess.
    assert DigestMatcher(b"o" * 32, m_rows(key, values)).find(text) == set()


def test_digest_matcher_finds_values_in_colour():
    """A terminal's colour codes around a value (logging formatters, rich, termcolor) do not
    hide it: the letter ending `\\x1b[31m` stands apart like a delimiter."""
    key = b"k" * 32
    m = DigestMatcher(key, m_rows(key, [SECRET]))
    for text in (
        f"\x1b[31m{SECRET}\x1b[0m",
        f"\x1b[1;38;5;208mkey: \x1b[0m\x1b[1m{SECRET}",
        f"[\x1b[32mINFO\x1b[0m] token=\x1b[4m{SECRET}\x1b[24m done",
    ):
        assert m.find(text) == {SECRET}, repr(text)
        assert SECRET not in m.scrub(text) and "\x1b[" in m.scrub(text)
    # (a value glued to letters that are not the end of a sequence stays unfound, as before)
    assert m.find(f"xm{SECRET}") == set()


def m_rows(key, values):
    return [(secret_digest(key, v), len(v), " " in v) for v in values]


def test_pickle_strings_reads_without_unpickling():
    class Boom:
        def __reduce__(self):
            return (os.system, ("echo should-never-run",))

    data = pickle.dumps({"a": [SECRET, b"bytes-value-123"], "boom": Boom()})
    strings = list(pickle_strings(data))
    assert SECRET in strings and "bytes-value-123" in strings
    assert any(SECRET in s for s in pickle_strings(b"\x00garbage\x8c" + SECRET.encode()))


# -- persistence through a store, and what the server and exports see ---------------------------


def test_the_server_follows_the_hashes_of_a_store_deleted_and_made_anew(tmp_path):
    """The new file has its own key and, here, as many hashes as the old one had: the server
    (which follows the path) matches the new values, not the old ones."""
    path = tmp_path / "t.sqlite"

    def record(value: str) -> None:
        store = TrajectoryStore(path)
        tid = store.create_trajectory()
        ks = KernelSecrets()
        ks.observe({"api_key": value}, "")
        assert ks.persist(store, tid) >= 1
        store.close()

    record("first-planted-0031")
    server = StoreRedactor(TrajectoryStore(path, follow=True))
    server.refresh()
    assert server.scrub_text("first-planted-0031") == REDACTED
    count = server.store.secret_digest_count()
    for f in tmp_path.glob("t.sqlite*"):
        f.unlink()
    record("other-planted-0032")
    assert server.store.secret_digest_count() == count
    server.refresh()
    assert server.scrub_text("other-planted-0032") == REDACTED
    assert server.scrub_text("first-planted-0031") == "first-planted-0031"


def test_values_persist_as_keyed_hashes_and_the_server_follows_them(tmp_path):
    path = tmp_path / "store" / "t.sqlite"
    store = TrajectoryStore(path)
    tid = store.create_trajectory()
    ks = KernelSecrets()
    ks.observe({"api_key": SECRET}, "")
    eid = store.add_execution(tid, {"source": ks.scrub(f"api_key = {SECRET!r}"), "status": "ok"})
    assert ks.persist(store, tid) == 1 and ks.persist(store, tid) == 0
    assert store.secret_digest_count() >= 1
    store.close()
    for f in path.parent.iterdir():
        if f.name != "t.sqlite.key":
            assert SECRET.encode() not in f.read_bytes(), f.name

    server = StoreRedactor(TrajectoryStore(path, readonly=True))
    server.refresh()
    # Text from elsewhere (the browser's cells, a request's source) is scrubbed by hash.
    assert server.scrub_text(f"v = '{SECRET}'") == f"v = '{REDACTED}'"
    assert server.blob_holds_secret(pickle.dumps({"x": [SECRET]}))
    assert not server.blob_holds_secret(pickle.dumps({"x": ["harmless-value"]}))
    v = server.scrub_variable({"name": "x", "type": "list", "summary": {"repr": f"[{SECRET!r}]"}})
    assert v["summary"] == {"redacted": True} and v["stub_reason"] == SECRET_VALUE_REASON
    assert server.scrub_execution(store_row(path, eid))["source"] == f"api_key = {REDACTED!r}"

    # Without the key the hashes are useless, and the server says nothing secret either way.
    key_path(path).unlink()
    blind = StoreRedactor(TrajectoryStore(path, readonly=True))
    blind.refresh()
    assert blind.scrub_text(f"v = '{SECRET}'") == f"v = '{SECRET}'"

    # A second kernel session follows the first one's values by hash.
    load_key(path)  # a new key: the old hashes no longer match anything
    store = TrajectoryStore(path)
    ks1 = KernelSecrets()
    ks1.observe({"hf_token": "second-planted-0007"}, "")
    ks1.persist(store, None)
    ks2 = KernelSecrets()
    ks2.load_digests(store)
    assert ks2.scrub("y = 'second-planted-0007'") == f"y = '{REDACTED}'"
    assert ks2.stub_reason("second-planted-0007") == SECRET_VALUE_REASON

    # A third kernel adds a value, then the key file is damaged: the second kernel can follow
    # no new value, and still follows the values it followed (it forgot them all).
    ks3 = KernelSecrets()
    ks3.observe({"hf_token": "third-planted-0008"}, "")
    ks3.persist(store, None)
    key_path(path).write_bytes(b"short")
    ks2.load_digests(store)
    assert ks2.scrub("y = 'second-planted-0007'") == f"y = '{REDACTED}'"


def store_row(path, eid):
    with TrajectoryStore(path, readonly=True) as s:
        return s.get_execution(eid)


def test_html_escaped_values_are_followed_and_replaced_in_html(tmp_path):
    value = "p&ss<w0rd>42\"q'x"
    # pandas (& < > only), html.escape (&quot; &#x27;), Jinja's markupsafe (&#34; &#39;)
    escaped = [html.escape(value, quote=False), html.escape(value), str(markupsafe.escape(value))]
    page = "".join(f"<td>{e}</td>" for e in escaped)
    scrubbed = "<td>&lt;redacted&gt;</td>" * 3
    path = tmp_path / "t.sqlite"
    store = TrajectoryStore(path)
    ks = KernelSecrets()
    ks.observe({"password": value}, "")
    assert ks.scrub(page) == scrubbed and ks.scrub(value) == REDACTED
    assert ks.stub_reason(escaped[1]) == SECRET_VALUE_REASON
    assert ks.stub_reason(data=pickle.dumps([escaped[0]])) == SECRET_VALUE_REASON
    # The server and the exports follow them by hash, and replace them the same way.
    ks.persist(store, None)
    store.close()
    server = StoreRedactor(TrajectoryStore(path, readonly=True))
    server.refresh()
    assert server.scrub_text(page) == scrubbed
    assert server.scrub_text(f"v = '{value}'") == f"v = '{REDACTED}'"
    assert server.blob_holds_secret(pickle.dumps({"x": escaped[2]}))


def test_a_value_learnt_late_is_scrubbed_from_earlier_rows_and_the_file(tmp_path):
    path = tmp_path / "t.sqlite"
    store = TrajectoryStore(path)
    tid = store.create_trajectory()
    late = "late-planted-value-0008"
    ks = KernelSecrets()
    # Cell 1 prints a value nobody knows is secret yet, and snapshots it.
    out = [{"output_type": "stream", "name": "stdout", "text": f"{late}\n"}]
    e1 = store.add_execution(tid, {"source": "print(val)", "status": "ok", "outputs": out})
    blob = store.put_blob(pickle.dumps(late))
    store.write_snapshot(
        e1, [{"name": "val", "type": "str", "summary": {"repr": repr(late)}, "blob_hash": blob}]
    )
    assert late.encode() in b"".join(f.read_bytes() for f in tmp_path.iterdir())
    # Cell 2 binds it to a secret name.
    ks.observe({"val": late, "secret_later": late}, "secret_later = val")
    store.add_execution(tid, {"source": "secret_later = val", "status": "ok"})
    ks.persist(store, tid)
    row = store.get_execution(e1)
    assert late not in json.dumps(row) and REDACTED in row["outputs"][0]["text"]
    (v,) = store.get_variables(e1)
    assert v["blob_hash"] is None and v["stub_reason"] == SECRET_VALUE_REASON
    assert not store.has_blob(blob)
    store.close()
    for f in tmp_path.iterdir():
        assert late.encode() not in f.read_bytes(), f.name


def test_a_variable_record_shared_by_snapshots_is_scrubbed_in_each(tmp_path):
    # Snapshots holding a variable unchanged share its one record (store schema 5): a value
    # learnt late leaves none of them, and the record is gone from the file.
    path = tmp_path / "t.sqlite"
    store = TrajectoryStore(path)
    tid = store.create_trajectory()
    late = "late-planted-value-0011"
    blob = store.put_blob(pickle.dumps(late))
    held = {"name": "val", "type": "str", "summary": {"repr": repr(late)}, "blob_hash": blob}
    other = {"name": "n", "type": "int", "summary": {"repr": "3"}}
    eids = []
    for n in range(3):
        eids.append(store.add_execution(tid, {"source": f"n = {n}", "status": "ok"}))
        store.write_snapshot(eids[-1], [dict(held, changed=n == 0), other])
    # A long output is stored compressed: scrubbed all the same.
    text = "".join(f"row {i}: {late if i == 37 else 'fine'}\n" for i in range(200))
    out = [{"output_type": "stream", "name": "stdout", "text": text}]
    printed = store.add_execution(tid, {"source": "print(rows)", "status": "ok", "outputs": out})
    sql = "SELECT typeof(outputs) FROM executions WHERE id = ?"
    assert store._conn().execute(sql, [printed]).fetchone()[0] == "blob"
    ks = KernelSecrets()
    ks.observe({"val": late, "secret_later": late}, "secret_later = val")
    store.add_execution(tid, {"source": "secret_later = val", "status": "ok"})
    ks.persist(store, tid)
    for eid in eids:
        by_name = {v["name"]: v for v in store.get_variables(eid)}
        assert by_name["val"]["stub_reason"] == SECRET_VALUE_REASON
        assert by_name["val"]["blob_hash"] is None and by_name["n"]["summary"] == {"repr": "3"}
    scrubbed = store.get_execution(printed)["outputs"][0]["text"]
    assert late not in scrubbed and REDACTED in scrubbed and "row 199: fine" in scrubbed
    records = store._conn().execute("SELECT name FROM variable_records ORDER BY name").fetchall()
    assert [r[0] for r in records] == ["n", "val"]  # the stub, once; the old record gone
    assert not store.has_blob(blob)
    store.close()
    for f in tmp_path.iterdir():
        assert late.encode() not in f.read_bytes(), f.name


def test_json_values_under_secret_keys_are_replaced_not_learnt():
    ks = KernelSecrets()
    outputs = [
        {
            "output_type": "display_data",
            "data": {"application/json": {"db": {"password": "json-planted-0009"}, "rows": 3}},
            "metadata": {},
        }
    ]
    out = ks.scrub_json(outputs)
    assert out[0]["data"]["application/json"] == {"db": {"password": REDACTED}, "rows": 3}
    assert "json-planted-0009" not in ks.values  # a plot spec's "key" fields are not secrets
    server = StoreRedactor(None)
    assert server.scrub_json({"api_token": "abcdefgh", "n": "abcdefgh"}) == {
        "api_token": REDACTED,
        "n": "abcdefgh",
    }


def test_a_value_learnt_from_a_later_output_is_scrubbed_from_the_earlier_ones():
    ks = KernelSecrets()
    first = ks.scrub_output("the value is early-printed-0010\n")
    second = ks.scrub_output("{'password': 'early-printed-0010'}")
    assert "early-printed-0010" in first and "early-printed-0010" not in second
    outputs = [{"output_type": "stream", "text": first}, {"output_type": "stream", "text": second}]
    assert "early-printed-0010" not in json.dumps(ks.scrub_json(outputs))
    # Nothing new learnt: the texts scrub_output returned are not scanned a second time.
    clean = ks.scrub_output("plain text")
    assert ks.scrub_json([clean]) == ["plain text"] and not ks._scrubbed


def test_bearer_and_stripe_shapes():
    header = "Authorization: Bearer abcdefghijklmnopqrstuvwxyz0123456789"
    assert redact_tokens(header) == f"Authorization: Bearer {REDACTED}"
    assert redact_tokens("key sk_live_" + "a1" * 12) == f"key {REDACTED}"
    assert redact_tokens("xsk_live_" + "a1" * 12) == "xsk_live_" + "a1" * 12  # not a word start
    assert KernelSecrets().bytes_hold_secret(pickle.dumps(["rk_test_" + "Z9" * 10]))
    assert not KernelSecrets().bytes_hold_secret(pickle.dumps(["wrk_test_" + "Z9" * 10]))


# -- hostile texts ------------------------------------------------------------------------------

PATHOLOGICAL = [
    "api_key:" + " " * 50_000 + "x",
    "api_key: " + "a " * 50_000,
    "{'password': '" + "\\\\" * 50_000,
    "sk-" + "a-" * 50_000 + "!",
    '"token"' + " " * 50_000 + ":",
    "x['token']" + " " * 50_000 + "=",
    "%env TOKEN" + " " * 50_000 + "=",
    "-----BEGIN RSA PRIVATE KEY-----" + "A" * 50_000,
    "token = " + "(" * 50_000,
]


@pytest.mark.parametrize("text", PATHOLOGICAL, ids=lambda t: repr(t[:14]))
def test_texts_built_to_make_the_patterns_backtrack_are_scanned_in_linear_time(text):
    # A regex that splits a run of spaces two ways takes hours on these (pytest's timeout
    # fails the test); every scrubber gets through each in milliseconds.
    ks = KernelSecrets()
    ks.learn(SECRET)
    server = StoreRedactor(None)
    for scrub in (redact_source, redact_tokens, ks.scrub_output, server.scrub_text):
        assert isinstance(scrub(text), str)


# (like the other property tests: generating examples on a loaded machine is not too slow)
@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    before=st.text(max_size=200),
    after=st.text(max_size=200),
    name=st.sampled_from(["api_key", "GITHUB_TOKEN", "db_password", "client_secret"]),
    value=st.text(
        alphabet=st.characters(blacklist_characters="'\"\\\n\r", blacklist_categories=["Cs"]),
        min_size=MIN_SECRET_VALUE_LEN,
        max_size=60,
    ).filter(lambda v: v.strip() == v and v != REDACTED),
    form=st.sampled_from(
        ['{n} = "{v}"', "{n}='{v}'", '{{"{n}": "{v}"}}', 'os.environ["{n}"] = "{v}"']
    ),
)
def test_a_planted_literal_never_survives_and_is_followed(before, after, name, value, form):
    code = f"{before}\n{form.format(n=name, v=value)}\n{after}"
    ks = KernelSecrets()
    ks.observe({}, code)
    assert value in ks.values
    assert value not in ks.scrub(redact_source(code))
    assert value not in ks.scrub(f"printed: {value}!")


def test_scrub_context_covers_every_text_field(tmp_path):
    from dataclasses import dataclass, field

    from jupyter_themisto.context import ContextCell, PredictionContext, VariableInfo

    @dataclass
    class RicherContext(PredictionContext):  # a field a later version might add
        cells_below: list[ContextCell] = field(default_factory=list)
        last_error: str = ""

    key = "sk-proj-PLANTEDabcdef0123456789xyz"
    ctx = RicherContext(
        cells=[ContextCell(source=f"k = {key!r}", output_text=f"{key}\n")],
        variables=[
            VariableInfo(name="x", type="str", summary={"repr": repr(key)}),
            VariableInfo(name="n", type="int", summary={"repr": "3"}),
        ],
        target_source=f"print({key!r})",
        cells_below=[ContextCell(source=f"use({key!r})")],
        last_error=f"KeyError: {key!r}",
    )
    out = StoreRedactor(TrajectoryStore(tmp_path / "t.sqlite")).scrub_context(ctx)
    assert key not in repr(out) and type(out) is RicherContext
    assert out.variables[0].summary == {"redacted": True}
    assert out.variables[1].summary == {"repr": "3"}
    assert out.cells[0].source == f"k = {REDACTED!r}" and ctx.cells[0].source != out.cells[0].source


def test_scrub_context_follows_a_value_the_context_binds_to_a_secret_name(tmp_path):
    """A value bound to a secret name by a literal anywhere in the context (here in a cell
    below) is scrubbed wherever else it appears, a variable's summary included, before the
    store has its keyed hash; nothing else changes."""
    from jupyter_themisto.context import ContextCell, PredictionContext, VariableInfo

    typed = "typed-only-here-0042"
    ctx = PredictionContext(
        cells=[ContextCell(source=f"connect({typed!r})", output_text=f"connected as {typed}")],
        variables=[
            VariableInfo(name="user", type="str", summary={"repr": repr(typed)}),
            VariableInfo(name="n", type="int", summary={"repr": "3"}),
        ],
        target_source=f"print({typed!r}, 'plain')",
        cells_below=[ContextCell(source=f"api_token = {typed!r}")],
    )
    out = StoreRedactor(TrajectoryStore(tmp_path / "t.sqlite")).scrub_context(ctx)
    assert typed not in repr(out)
    assert out.cells[0].source == f"connect({REDACTED!r})"
    assert out.target_source == f"print({REDACTED!r}, 'plain')"
    assert out.variables[0].summary == {"redacted": True}
    assert out.variables[1].summary == {"repr": "3"}


def store_with_a_hash(tmp_path: Path, value: str) -> tuple[TrajectoryStore, Path]:
    """A store holding the keyed hash of `value`, as a kernel records it, and its key's path."""
    from jupyter_themisto.redaction import key_path

    store = TrajectoryStore(tmp_path / "t.sqlite")
    secrets = KernelSecrets()
    secrets.learn(value)
    secrets.persist(store, None)
    return store, key_path(store.path)


def test_a_store_whose_key_cannot_follow_its_hashes_is_said_once(tmp_path):
    """The server's redactor says (once, through `warn`) when the values the store holds as
    keyed hashes cannot be followed: the key missing or damaged, or replaced by another; with
    the key back it says nothing more."""
    store, key = store_with_a_hash(tmp_path, "a-planted-secret-value-77")
    saved = key.read_bytes()
    said: list[str] = []
    redactor = StoreRedactor(store, warn=said.append)
    redactor.refresh()
    assert said == [] and redactor.problem is None
    for damage in (key.unlink, lambda: key.write_bytes(b"short")):
        damage()
        redactor = StoreRedactor(store, warn=said.append)
        redactor.refresh()
        redactor.refresh()
        assert len(said) == 1 and "is missing or damaged" in said[0] and str(key) in said[0]
        assert "a-planted-secret-value-77" not in said[0]
        said.clear()
    key.write_bytes(saved)
    redactor = StoreRedactor(store, warn=said.append)
    redactor.refresh()
    assert said == [] and redactor.problem is None and redactor.matcher
    # A new key (as a later kernel makes one): the first hashes were made with another.
    key.unlink()
    again = KernelSecrets()
    again.learn("another-planted-value-78")
    again.persist(store, None)
    redactor = StoreRedactor(store, warn=said.append)
    redactor.refresh()
    assert len(said) == 1 and "made with another key" in said[0]
    store.close()


def test_a_kernel_reading_hashes_without_their_key_makes_none_and_finds_it_back(tmp_path):
    """A kernel that finds hashes but no key makes no key (one made then could follow none of
    them, and would hide the loss behind a key that looks fine); the key put back is found at
    the next execution."""
    store, key = store_with_a_hash(tmp_path, "a-planted-secret-value-79")
    saved = key.read_bytes()
    key.unlink()
    later = KernelSecrets()
    later.load_digests(store)
    assert not key.exists() and not later.matcher
    key.write_bytes(saved)
    later.load_digests(store)
    assert later.matcher and later.scrub("x = 'a-planted-secret-value-79'") == f"x = {REDACTED!r}"
    store.close()


def test_a_key_made_over_hashes_without_a_mark_is_told_too(tmp_path):
    """Hashes recorded before keys were marked, and their key lost: the kernel that makes a
    new key marks the lost one, so that readers tell it (they could not have otherwise)."""
    from jupyter_themisto.redaction import key_problem, load_key

    store, key = store_with_a_hash(tmp_path, "a-planted-secret-value-80")
    with store._write() as conn:  # (as written before the marks)
        conn.execute("DELETE FROM secret_digests WHERE length = 0")
    key.unlink()
    later = KernelSecrets()
    later.learn("another-planted-value-81")
    later.persist(store, None)
    problem = key_problem(store.path, load_key(store.path, create=False), store.secret_digests())
    assert problem is not None and "made with another key" in problem
    store.close()
