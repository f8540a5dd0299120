"""Shared pytest fixtures: an isolated trajectory store for every test, and that store opened."""

from __future__ import annotations

import pytest

from jupyter_themisto.store import TrajectoryStore

pytest_plugins = ("pytest_jupyter.jupyter_server",)


@pytest.fixture
def store_path(tmp_path, monkeypatch):
    """A fresh THEMISTO_STORE path, exported so kernels started by the test inherit it."""
    path = tmp_path / "store" / "trajectories.sqlite"
    monkeypatch.setenv("THEMISTO_STORE", str(path))
    return path


@pytest.fixture
def store(store_path):
    """The TrajectoryStore at store_path, closed after the test."""
    s = TrajectoryStore(store_path)
    yield s
    s.close()
