"""Typed backend settings: unknown settings and wrong types are refused with a message naming
the backend and the setting, defaults are those the backends always had, the server logs
refused settings at start, answers with them, and serves each backend's JSON schema, and the
README's settings tables are the models'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tornado.httpclient import HTTPClientError

from jupyter_themisto.backends import (
    InvalidSettings,
    available_backends,
    check_backend_settings,
    create_backend,
    load_backend_class,
    settings_schema,
)
from jupyter_themisto.backends.readme_tables import main as settings_main
from jupyter_themisto.backends.readme_tables import readme_tables
from jupyter_themisto.store import TrajectoryStore

README = Path(__file__).resolve().parent.parent / "README.md"
BUILTIN = [
    "retrieval",
    "openai",
    "anthropic",
    "llamacpp",
    "seq2seq",
    "preview",
    "repeat-previous",
    "ret-train",
    "ret-context",
]


@pytest.mark.parametrize("name", BUILTIN)
def test_a_typo_is_refused_naming_backend_and_setting(name):
    with pytest.raises(InvalidSettings) as info:
        create_backend(name, {"max_trajectorys": 5})
    message = str(info.value)
    assert message.startswith(f"{name} backend settings: max_trajectorys: unknown setting")
    declared = load_backend_class(name).settings_model
    assert declared is not None
    for known in declared.model_fields:
        assert known in message  # what it may have meant
    # Validation alone (the server's check at start) says the same without making it.
    assert check_backend_settings({name: {"max_trajectorys": 5}}) == [message]


@pytest.mark.parametrize(
    ("name", "settings", "expected"),
    [
        ("retrieval", {"max_trajectories": "many"}, "max_trajectories: Input should be a valid"),
        ("retrieval", {"history": "perhaps"}, "history: Input should be a valid boolean"),
        ("retrieval", {"context_cells": 0}, "context_cells: Input should be greater than or"),
        ("openai", {"timeout": "soon"}, "timeout: Input should be a valid number"),
        ("openai", {"api": "responses"}, "api: Input should be 'chat' or 'completions'"),
        ("openai", {"max_retries": -1}, "max_retries: Input should be greater than or equal"),
        ("anthropic", {"max_tokens": 1.5}, "max_tokens: Input should be a valid integer"),
        ("llamacpp", {"parallel": 0}, "parallel: Input should be greater than or equal to 1"),
        ("llamacpp", {"model": "gpt"}, "model: unknown model 'gpt'"),
        ("llamacpp", {"prompt_runtime": "middle"}, "prompt_runtime: Input should be 'none'"),
        ("llamacpp", {"prompt_colour": 1}, "prompt_colour: unknown setting (known: "),
        ("llamacpp", {"retrieval": {"histroy": False}}, "retrieval.histroy: unknown setting"),
        ("llamacpp", {"n_ctx": 128, "max_tokens": 256}, "must fit n_ctx (128)"),
        ("seq2seq", {"max_input_tokens": "lots"}, "max_input_tokens: Input should be a valid"),
        ("preview", {"fallback": "preview"}, "fallback: the fallback backend cannot be preview"),
        ("preview", {"memory_mb": 0}, "memory_mb: Input should be greater than 0"),
        ("preview", {"fallback_config": [1]}, "fallback_config: Input should be a valid dict"),
        (
            "preview",
            {"fallback": "retrieval", "fallback_config": {"histroy": True}},
            "fallback_config: histroy: unknown setting"
            " (known: context_cells, continuation_cells, corpus_dir",
        ),
        ("ret-train", {"max_trajectories": None}, "max_trajectories: Input should be a valid"),
    ],
)
def test_wrong_values_are_refused_naming_the_setting(name, settings, expected):
    with pytest.raises(InvalidSettings, match=f"^{name} backend settings: ") as info:
        create_backend(name, settings)
    assert expected in str(info.value)
    # Still a ValueError and a BackendUnavailable (503) for the code that catches those.
    assert isinstance(info.value, ValueError) and info.value.status == 503


def test_nested_known_settings_are_listed():
    with pytest.raises(InvalidSettings) as info:
        create_backend("llamacpp", {"retrieval": {"histroy": False}})
    assert (
        "(known: context_cells, continuation_cells, corpus_dir, history, max_trajectories"
        in str(info.value)
    )


def test_settings_must_be_a_mapping():
    with pytest.raises(InvalidSettings, match="retrieval backend settings: must be a mapping"):
        create_backend("retrieval", ["history"])  # type: ignore[arg-type]


def test_a_refused_key_is_never_repeated():
    secret = "sk-do-not-echo-0123456789"
    for bad in ({"api_key": {"value": secret}}, {"api_key": [secret]}, {"apikey": secret}):
        with pytest.raises(InvalidSettings) as info:
            create_backend("openai", bad)
        assert secret not in str(info.value) and "openai backend settings" in str(info.value)
        assert info.value.__cause__ is None and info.value.__suppress_context__


def test_values_given_as_text_are_read_as_their_type():
    b = create_backend("retrieval", {"max_trajectories": "7", "history": "false"})
    assert (b.settings.max_trajectories, b.settings.history) == (7, False)


def test_defaults_are_unchanged(monkeypatch):
    for var in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    r = create_backend("retrieval")
    assert (
        r.corpus_dir,
        r.settings.history,
        r.settings.max_trajectories,
        r.settings.context_cells,
    ) == (None, True, 500, 2)
    assert r.settings.sync_rebuild_seconds == 0.02
    for name, url, model in [
        ("openai", "https://api.openai.com/v1", "gpt-4o-mini"),
        ("anthropic", "https://api.anthropic.com", "claude-3-5-haiku-latest"),
    ]:
        h = create_backend(name)
        assert (h.base_url, h.model, h._api_key) == (url, model, "")
        assert (h.settings.timeout, h.settings.connect_timeout, h.settings.max_retries) == (
            30.0,
            5.0,
            2,
        )
        assert (
            h.settings.backoff,
            h.settings.max_backoff,
            h.settings.max_tokens,
            h.settings.temperature,
        ) == (0.5, 20.0, 256, 0.2)
        assert (
            h.settings.max_line_bytes,
            h.settings.max_event_bytes,
            h.settings.max_response_bytes,
        ) == (
            256 * 1024,
            1024 * 1024,
            16 * 1024 * 1024,
        )
    assert create_backend("openai").api == "chat"
    # An empty model or URL still means the default, the environment still fills in.
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1/")
    o = create_backend("openai", {"model": "", "base_url": ""})
    assert (o.model, o.base_url, o._api_key) == ("gpt-4o-mini", "http://127.0.0.1:9/v1", "sk-env")
    assert create_backend("openai", {"api_key": "sk-given"})._api_key == "sk-given"
    ll = create_backend("llamacpp")
    assert (
        ll.settings.model,
        ll.settings.n_ctx,
        ll.settings.parallel,
        ll.settings.cache_ram_mb,
    ) == (
        "qwen2.5-coder-0.5b",
        2048,
        2,
        256,
    )
    assert (ll.settings.flash_attn, ll.settings.prompt_budget(), ll.n_threads >= 1) == (
        False,
        1024,
        True,
    )
    assert (
        ll.settings.max_tokens,
        ll.settings.output_max_tokens,
        ll.settings.max_lines,
        ll.settings.suggestion_timeout,
        ll.settings.output_timeout,
    ) == (128, 128, 30, 5.0, 15.0)
    assert (ll.settings.temperature, ll.settings.sample_temperature, ll.settings.seed) == (
        0.0,
        0.8,
        0,
    )
    from jupyter_themisto.backends.prompts import PromptOptions

    assert ll.prompt_options == PromptOptions()
    assert (ll.prompt_options.examples, ll.prompt_options.example_lines) == (0, 12)
    # max_prompt_tokens shrinks to fit a small window, as before.
    assert create_backend("llamacpp", {"n_ctx": 512}).settings.prompt_budget() == 512 - 128
    p = create_backend("preview")
    assert (
        p.settings.timeout,
        p.settings.memory_mb,
        p.settings.cpu_seconds,
        p.settings.busy_wait,
        p.settings.fallback,
    ) == (
        50.0,  # (issue 12: a preview runs as long as a long cell would, still bounded)
        1024,
        60,
        1.0,
        None,
    )
    assert create_backend("preview", {"fallback": ""}).settings.fallback is None
    assert create_backend("ret-train").settings.max_trajectories == 1000
    assert create_backend("seq2seq").settings.max_input_tokens is None


def test_the_llamacpp_retrieval_candidates_get_their_settings():
    b = create_backend("llamacpp", {"retrieval": {"max_trajectories": 9}})
    assert b.settings.retrieval is not None and b.settings.retrieval.max_trajectories == 9


def test_host_check_names_backends_that_are_not_installed():
    problems = check_backend_settings({"retreival": {}, "retrieval": {"history": False}})
    assert len(problems) == 1
    assert "'retreival', which is not an installed backend (installed: " in problems[0]
    assert "retrieval" in problems[0]


def test_every_builtin_backend_serves_a_strict_schema():
    for name in BUILTIN:
        schema = settings_schema(load_backend_class(name))
        assert schema is not None and schema["type"] == "object"
        assert schema["additionalProperties"] is False
    retrieval = settings_schema(load_backend_class("retrieval"))
    assert retrieval is not None
    props = retrieval["properties"]
    assert props["max_trajectories"]["default"] == 500
    assert props["max_trajectories"]["type"] == "integer"
    assert props["max_trajectories"]["description"]
    openai = settings_schema(load_backend_class("openai"))
    assert openai is not None
    assert openai["properties"]["api_key"]["anyOf"][0]["writeOnly"] is True
    # Built once per process; what a caller does to its copy changes no later answer.
    props["max_trajectories"]["default"] = -1
    openai["properties"].clear()
    again = settings_schema(load_backend_class("retrieval"))
    assert again is not None and again["properties"]["max_trajectories"]["default"] == 500
    again = settings_schema(load_backend_class("openai"))
    assert again is not None and "api_key" in again["properties"]


def test_readme_tables_are_generated_from_the_models(tmp_path):
    text = README.read_text(encoding="utf-8")
    assert readme_tables(text) == text, (
        "README's settings tables differ from the models: run"
        " `python -m jupyter_themisto.backends.readme_tables README.md`"
    )
    # Every built-in backend with settings has a table, and each setting is in one.
    for name in BUILTIN:
        model = load_backend_class(name).settings_model
        assert model is not None
        if model.model_fields:
            assert f"<!-- settings: {name}" in text
            for field in model.model_fields:
                assert f"| `{field}` |" in text
    # The script rewrites a stale table and --check says so.
    stale = tmp_path / "README.md"
    stale.write_text(
        "x\n<!-- settings: ret-train -->\n| old |\n<!-- /settings -->\ny\n", encoding="utf-8"
    )
    assert settings_main(["--check", str(stale)]) == 1
    assert settings_main([str(stale)]) == 0
    fixed = stale.read_text(encoding="utf-8")
    assert "| old |" not in fixed and "| `max_trajectories` | `1000` |" in fixed
    assert settings_main(["--check", str(stale)]) == 0


# -- through a real server -------------------------------------------------------------------


@pytest.fixture
def jp_server_config(store_path):
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_themisto": True}},
        "ThemistoExtensionApp": {
            "auto_record": False,
            "default_backend": "retrieval",
            "backend_settings": {
                "retrieval": {"max_trajectorys": 50},
                "ret-train": {"max_trajectories": 10},
                "retreival": {},
            },
        },
    }


async def test_server_logs_refused_settings_and_answers_with_them(capfd, jp_fetch, store_path):
    # (capfd first: it is listening when the server starts and logs to stderr)
    errors = [line for line in capfd.readouterr().err.splitlines() if "[E " in line]
    assert any(
        "ThemistoExtensionApp] themisto: retrieval backend settings: max_trajectorys: unknown"
        " setting (known: context_cells, continuation_cells, corpus_dir, history, max_trajectories"
        in e
        for e in errors
    ), errors
    assert any("'retreival', which is not an installed backend" in e for e in errors), errors
    store = TrajectoryStore(store_path)
    tid = store.create_trajectory(kernel_id="k")
    store.add_execution(tid, {"source": "x = 1", "status": "ok"})
    store.close()
    with pytest.raises(HTTPClientError) as info:
        await jp_fetch(
            "themisto", "predict", "next-cell", method="POST", body=json.dumps({"kernel_id": "k"})
        )
    assert info.value.code == 503
    message = json.loads(info.value.response.body)["message"]
    assert message.startswith("retrieval backend settings: max_trajectorys: unknown setting")
    r = await jp_fetch("themisto", "backends")
    entries = {b["name"]: b for b in json.loads(r.body)["backends"]}
    assert entries["retrieval"]["health"]["ok"] is False
    assert "max_trajectorys: unknown setting" in entries["retrieval"]["health"]["detail"]
    # Backends with good settings work as ever.
    assert entries["ret-train"]["health"]["ok"] is True


async def test_server_serves_each_backends_settings_schema(jp_fetch):
    r = await jp_fetch("themisto", "backends")
    entries = {b["name"]: b for b in json.loads(r.body)["backends"]}
    assert set(BUILTIN) <= set(entries) <= set(available_backends())
    for name in BUILTIN:
        schema = entries[name]["settings_schema"]
        assert schema == settings_schema(load_backend_class(name)), name
        assert schema["additionalProperties"] is False
    # Served even for a backend whose settings are refused (it says how to fix them).
    retrieval = entries["retrieval"]["settings_schema"]["properties"]
    assert retrieval["max_trajectories"]["default"] == 500
    assert entries["ret-train"]["settings_schema"]["properties"]["max_trajectories"]["default"] == (
        1000
    )
    assert entries["preview"]["settings_schema"]["properties"]["fallback_config"]
