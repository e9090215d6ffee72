"""Reading and writing weights: target checkpoints (HF safetensors directories, GGUF files) and strict
tensor loading shared by every model of `eyas.common`.

Models are built on the meta device and loaded with `assign=True`, so weights are allocated once,
in the dtype and on the device chosen here.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from .config import ConfigError, RopeConfig, TargetConfig, errors_naming, read_json
from .layers import rope_inv_freq
from .target import TargetModel


class CheckpointError(ValueError):
    """A checkpoint does not match its model; the message names the file and the tensor."""


def load_strict(
    module: nn.Module,
    tensors: Mapping[str, Tensor],
    *,
    source: str,
    dtype: torch.dtype | None,
    device: torch.device | str,
    ignore: tuple[str, ...] = (),
    only: Collection[str] | None = None,
) -> None:
    """Loads `tensors` into `module` (built on meta) by exact name and shape, assigning storage.

    A missing, unexpected or misshaped tensor raises a `CheckpointError` naming it. `ignore` lists
    names that may be present and are dropped. `only` loads just those of the module's tensors, the others
    staying as they are (on meta), and drops the other tensors of `tensors`. Floating tensors are cast to `dtype`
    (None: kept); integer and bool tensors (vocabulary maps) keep theirs.
    """
    expected = module.state_dict()
    if only is not None:
        expected = {name: expected[name] for name in only}
        tensors = {name: t for name, t in tensors.items() if name in expected}
    problems = []
    for name in sorted(set(tensors) - set(expected) - set(ignore)):
        problems.append(f"unexpected tensor '{name}' {tuple(tensors[name].shape)}")
    for name in sorted(set(expected) - set(tensors)):
        problems.append(f"missing tensor '{name}' (expected shape {tuple(expected[name].shape)})")
    for name in sorted(set(expected) & set(tensors)):
        if tensors[name].shape != expected[name].shape:
            problems.append(
                f"tensor '{name}' has shape {tuple(tensors[name].shape)}, expected {tuple(expected[name].shape)}"
            )
        elif expected[name].dtype.is_floating_point != tensors[name].dtype.is_floating_point or (
            expected[name].dtype == torch.bool
        ) != (tensors[name].dtype == torch.bool):
            problems.append(f"tensor '{name}' has dtype {tensors[name].dtype}, expected {expected[name].dtype}")
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))
    state = {}
    for name in expected:
        t = tensors[name]
        cast = dtype if (dtype is not None and t.dtype.is_floating_point) else t.dtype
        state[name] = t.to(device=device, dtype=cast)
    module.load_state_dict(state, strict=only is None, assign=True)


def load_weights_only(path: str | Path) -> object:
    """`torch.load` of tensors and plain containers, on the CPU. A file that does not load (JSON, numpy, cut short) is
    a CheckpointError of one line, for the caller to name the file: torch's own message names none, and its advice,
    loading with weights_only=False, would run the file's code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        reason = ("it holds more than tensors and plain containers" if isinstance(err, pickle.UnpicklingError)
                  else str(err).splitlines()[0] if str(err) else type(err).__name__)
        raise CheckpointError(reason) from err


def read_weights_dir(path: Path, names: Collection[str] | None = None) -> dict[str, Tensor]:
    """All tensors of an HF directory: `model.safetensors`, the shards its index names, or (older
    EAGLE heads) `pytorch_model.bin`. With `names`, only those are read from safetensors files."""
    index = path / "model.safetensors.index.json"
    if (path / "pytorch_model.bin").exists() and not index.exists() and not (path / "model.safetensors").exists():
        try:
            return load_weights_only(path / "pytorch_model.bin")
        except CheckpointError as err:
            raise CheckpointError(f"{path / 'pytorch_model.bin'}: not a readable PyTorch weights file ({err})") from err
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")
    tensors = {}
    for name in files:
        shard = path / name
        if not shard.exists():
            raise CheckpointError(f"{index}: names shard '{name}', which does not exist")
        try:
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
                    if names is None or key in names:
                        tensors[key] = f.get_tensor(key)
        except SafetensorError as err:  # a truncated or corrupt file: its own message names no file
            raise CheckpointError(f"{shard}: not a readable safetensors file ({err}); copy it again") from err
    return tensors


def save_safetensors(tensors: Mapping[str, Tensor], path: Path) -> None:
    """Writes `tensors` to `path`, readable as the process's umask lets any file it makes be: safetensors 0.8
    writes its files for their owner alone, so a head trained by one user (or as root in a container) could not be
    served by another."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _gguf_parts(path: Path) -> tuple[str, str]:
    return str(path.parent), path.name


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within it (or a function it decorates), each GGUF file is parsed once: every `gguf.GGUFReader` of the same
    file is the first one made (transformers makes its own for the config, the tensors and the tokenizer, and eyas
    one for the RoPE scaling; SmolLM2's `load_models` on a 2-core CPU took 24.4-29.1 s with four parses and
    16.8-17.3 s with one: docs/perf.md, forty-fifth entry). Readers only read (their tensors map the file), so
    sharing one is safe; they are let go at the end. Nested uses share the outermost's readers."""
    try:
        import gguf
    except ImportError:  # no GGUF to read: nothing to share
        yield
        return
    made = gguf.GGUFReader
    if getattr(made, "shared", False):
        yield
        return
    readers: dict[tuple, object] = {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = made(path, *args, **kwargs)
        return readers[key]

    reader.shared = True
    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = made


@gguf_parsed_once()
def read_gguf(path: Path) -> tuple[dict, dict[str, Tensor]]:
    """(HF config dict, dequantised fp32 tensors under HF names) of a GGUF file, via transformers + gguf, the file
    parsed once. A tensor the model needs and the file lacks is an error (transformers would fill it with random
    values)."""
    from transformers import AutoModelForCausalLM

    scaling = _gguf_rope_scaling(path)  # first: a scaling eyas cannot read fails before the tensors are dequantised
    folder, name = _gguf_parts(path)
    # transformers owns GGUF's name mapping, dequantisation and the q/k rotary permutation.
    with errors_naming(path):  # transformers' refusal: an architecture or quantisation it does not read
        hf_model, info = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, output_loading_info=True)
    for kind in ("missing_keys", "mismatched_keys"):
        if info[kind]:
            names = sorted(str(key) for key in info[kind])
            raise CheckpointError(f"{path}: {kind.replace('_keys', '')} tensors {', '.join(names[:8])}"
                                  + (f" and {len(names) - 8} more" if len(names) > 8 else ""))
    return _with_rope_scaling(hf_model.config.to_dict(), scaling), dict(hf_model.state_dict())


@gguf_parsed_once()
def gguf_config(path: Path) -> dict:
    """The HF config dict of a GGUF file: transformers' reading of its metadata, with the RoPE scaling that reading
    drops (`_gguf_rope_scaling`)."""
    from transformers import AutoConfig

    scaling = _gguf_rope_scaling(path)
    folder, name = _gguf_parts(path)
    with errors_naming(path):
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    return _with_rope_scaling(config.to_dict(), scaling)


def _with_rope_scaling(config: dict, scaling: dict | None) -> dict:
    return config if scaling is None else config | {"rope_scaling": scaling}


def _gguf_rope_scaling(path: Path) -> dict | None:
    """The `rope_scaling` of a GGUF file that transformers' reading drops, or None: llama.cpp keeps Llama 3's scaling
    as a `rope_freqs` tensor of per-frequency divisors (its converter writes them from the HF rule with the HF defaults
    but `factor`), and linear scaling as metadata; other scalings are refused."""
    try:
        import gguf
    except ImportError as err:
        raise ImportError(f"{path}: reading GGUF needs the 'gguf' package: pip install 'eyas[gguf]'") from err
    with errors_naming(path, "not a readable GGUF file", CheckpointError):
        reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def field(key: str, default=None):
        return reader.fields[key].contents() if key in reader.fields else default

    scaling = field(f"{arch}.rope.scaling.type", "none")
    divisors = next((t.data for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if scaling == "linear":
        return {"rope_type": "linear", "factor": float(field(f"{arch}.rope.scaling.factor"))}
    if scaling != "none":
        raise ConfigError(f"{path}: RoPE scaling '{scaling}' ({arch}.rope.scaling.type) is not supported "
                          "(linear, or Llama 3's rope_freqs)")
    if divisors is None:
        return None
    theta = float(field(f"{arch}.rope.freq_base", RopeConfig.theta))
    return _llama3_scaling(path, torch.tensor(divisors, dtype=torch.float32), theta)


def _llama3_scaling(path: Path, divisors: Tensor, theta: float) -> dict:
    """The llama3 `rope_scaling` whose inverse frequencies are the plain ones divided by `divisors` [head_dim // 2]."""
    source = f"{path} (rope_freqs.weight)"
    head_dim = 2 * divisors.numel()
    llama3 = RopeConfig(theta=theta, type="llama3", factor=float(divisors.max()))
    plain = RopeConfig(theta=theta)
    if not torch.allclose(rope_inv_freq(plain, head_dim) / rope_inv_freq(llama3, head_dim), divisors, rtol=1e-4):
        raise ConfigError(f"{source}: its {divisors.numel()} frequency divisors are not Llama 3's RoPE scaling "
                          f"(factor {llama3.factor:g}, low and high frequency factors 1 and 4, original context "
                          "8192), which is the one per-frequency scaling eyas reads")
    return llama3.to_hf()["rope_scaling"]


def target_config(path: str | Path) -> TargetConfig:
    path = Path(path)
    if path.suffix == ".gguf":
        return TargetConfig.from_hf(gguf_config(path), source=str(path))
    if not (path / "config.json").exists():
        raise ConfigError(f"{path}: not a .gguf file and no config.json inside")
    return TargetConfig.from_json(path / "config.json")


def load_target(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    only: Collection[str] | None = None,
) -> TargetModel:
    """Builds a `TargetModel` from an HF directory or a `.gguf` file, in `dtype` on `device`.

    `only` (HF names) loads just those tensors, the rest of the model staying on the meta device (no memory;
    running it fails); from an HF directory only they are read (a 70B target's embedding, final norm and lm_head
    are 4.2 GB of its 141), a .gguf file is dequantised whole first. A tied target's `lm_head.weight` is its
    embedding: asked for, it is skipped."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"target checkpoint {path} does not exist")
    if path.suffix == ".gguf":
        hf_config, tensors = read_gguf(path)
        cfg = TargetConfig.from_hf(hf_config, source=str(path))
    else:
        cfg = target_config(path)
        tensors = read_weights_dir(path, only)
    with torch.device("meta"):
        model = TargetModel(cfg)
    # Tied checkpoints sometimes also store lm_head.weight (a copy of the embedding).
    ignore = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    if only is not None:
        only = [name for name in only if name not in ignore]
    load_strict(model, tensors, source=str(path), dtype=dtype, device=device, ignore=ignore, only=only)
    model.rotary.reset_parameters(device)
    return model.eval()

