"""Draft-head directories: `config.json` + weights, in the layouts other engines read and write.

- EAGLE-3 (SGLang/vLLM/SpecForge): architectures ["LlamaForCausalLMEagle3"], keys `fc`, `midlayer.*`,
  `norm`, `lm_head`, `d2t` (int64 offsets), `t2d` (bool). Original heads say ["LlamaForCausalLM"] and
  carry `draft_vocab_size`. An `embed_tokens.weight` is accepted and ignored (the target's is used).
- EAGLE-1/2 (`LlamaForCausalLMEagle`, or a plain `LlamaForCausalLM` config without `draft_vocab_size`):
  `fc` (+ bias), `layers.N.*`; embedding and lm_head come from the target.
- vLLM speculators (`speculators_model_type: eagle3`): the EAGLE-3 weights under `layers.0.*`, a config
  wrapping the layer config; exported with `export_speculators`, and read back.

The config travels with the weights: a head is rebuilt from its own `config.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .checkpoint import CheckpointError, load_strict, read_weights_dir, save_safetensors
from .config import ConfigError, TargetConfig, errors_naming, read_json
from .eagle import EAGLE_ARCHITECTURE, EagleConfig, EagleHead
from .eagle3 import EAGLE3_ARCHITECTURE, UNSUPPORTED_FLAGS, Eagle3Config, Eagle3Head, is_eagle3_config
from .hot_vocab import HotVocab
from .target import TargetModel

DraftHead = Eagle3Head | EagleHead


def head_kind(cfg: dict[str, Any], source: str) -> str:
    """'eagle3', 'speculators' or 'eagle', from a head's config.json."""
    if "speculators_model_type" in cfg:
        if cfg["speculators_model_type"] != "eagle3":
            raise ConfigError(f"{source}: speculators_model_type {cfg['speculators_model_type']!r} is not supported")
        return "speculators"
    if is_eagle3_config(cfg):
        return "eagle3"
    if (cfg.get("architectures") or [None])[0] in (EAGLE_ARCHITECTURE, "LlamaForCausalLM"):
        return "eagle"
    raise ConfigError(
        f"{source}: field 'architectures' is {cfg.get('architectures')!r}; expected "
        f"['{EAGLE3_ARCHITECTURE}'], ['{EAGLE_ARCHITECTURE}'] or a speculators config"
    )


def _speculators_layer_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(f"{source}: field 'transformer_layer_config' must be an object")
    # vLLM, which serves this layout, takes norm_before_residual as true where the config leaves it out.
    merged = {**layer, "architectures": [EAGLE3_ARCHITECTURE], "norm_before_residual": True}
    for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids",
                *UNSUPPORTED_FLAGS):
        if cfg.get(key) is not None:
            merged[key] = cfg[key]
    return merged


def head_config_path(path: str | Path) -> Path:
    """A head directory's config.json; FileNotFoundError naming the directory and what it lacks (cheap: callers
    check before loading anything large)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        missing = "no config.json" if path.is_dir() else "not a directory" if path.exists() else "no such directory"
        raise FileNotFoundError(f"draft head {path}: {missing}")
    return path / "config.json"


def load_draft_head(
    path: str | Path,
    target: TargetModel | None = None,
    *,
    token_map: str | Path | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> DraftHead:
    """Loads any supported head directory. `target` gives EAGLE-1/2 heads their lm_head, and is checked to be the
    model the head was trained for; `token_map` (an FR-Spec `freq_N.pt`) restricts that lm_head, or an EAGLE-3
    head's own draft vocabulary, to the tokens it names. `dtype` None: the target's where one is given (the head
    computes on its embeddings and lm_head), else the checkpoint's."""
    path = Path(path)
    config_path = head_config_path(path)
    source = str(config_path)
    cfg = read_json(config_path)
    kind = head_kind(cfg, source)
    if dtype is None and target is not None:
        dtype = target.embed_tokens.weight.dtype
    if kind == "speculators":
        cfg = _speculators_layer_config(cfg, source)
    config = EagleConfig.from_hf(cfg, source) if kind == "eagle" else Eagle3Config.from_hf(cfg, source)
    if target is not None:
        _check_fits(config, target.config, source)
    tensors = read_weights_dir(path)
    if kind == "eagle":
        hot = HotVocab.load_token_map(token_map, config.vocab_size) if token_map else None
        with torch.device("meta"):
            head = EagleHead(config, hot)
        load_strict(head, tensors, source=str(path), dtype=dtype, device=device,
                    ignore=("embed_tokens.weight", "lm_head.weight"))
        if target is not None:
            head.attach_lm_head(target.lm_head_weight.to(device))
    else:
        # Speculators and newer SGLang/vLLM heads name the layer `layers.0`; ours is `midlayer`.
        tensors = {k.replace("layers.0.", "midlayer.", 1): v for k, v in tensors.items()}
        if "d2t" not in tensors and config.draft_vocab_size == config.vocab_size:
            tensors = {**tensors, **_identity_vocab(config.vocab_size)}
        elif "t2d" not in tensors and isinstance(tensors.get("d2t"), torch.Tensor):  # SGLang and vLLM read d2t alone
            tensors = {**tensors, "t2d": _marked(tensors["d2t"], config.vocab_size)}
        with torch.device("meta"):
            head = Eagle3Head(config)
        load_strict(head, tensors, source=str(path), dtype=dtype, device=device, ignore=("embed_tokens.weight",))
        _check_vocab_maps(head, str(path))
        if token_map:
            allowed = HotVocab.load_token_map(token_map, config.vocab_size)
            try:
                head.keep_draft_tokens(allowed)
            except ValueError as err:
                raise ConfigError(f"token map {token_map}, for the head {path}: {err}") from err
    head.rotary.reset_parameters(device)
    return head.eval()


def _check_fits(config: EagleConfig | Eagle3Config, target: TargetConfig, source: str) -> None:
    """A head trained for another target (a Qwen3-8B head on Llama-3.1-8B: both 4,096 wide) drafts another
    tokenizer's ids or reads streams of another width: refused here, naming the field, not at a draft step."""
    fields = [("vocab_size", config.vocab_size, target.vocab_size, "vocabulary")]
    if isinstance(config, Eagle3Config):
        fields.append(("target_hidden_size", config.target_hidden_size, target.hidden_size, "hidden size"))
    for key, value, wanted, what in fields:
        if value != wanted:
            raise ConfigError(f"{source}: field '{key}' is {value}, but the target's {what} is {wanted}: a head "
                              "trained for another target model")
    if isinstance(config, Eagle3Config):
        with errors_naming(source):
            config.aux_layers_for(target)


def _marked(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d from d2t: True at each target id i + d2t[i] (ids out of range are refused by `_check_vocab_maps`)."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    ids = torch.arange(len(d2t)) + d2t.long()
    t2d[ids[(ids >= 0) & (ids < vocab_size)]] = True
    return t2d


def _identity_vocab(vocab_size: int) -> dict[str, torch.Tensor]:
    return {"d2t": torch.zeros(vocab_size, dtype=torch.long), "t2d": torch.ones(vocab_size, dtype=torch.bool)}


def _check_vocab_maps(head: Eagle3Head, source: str) -> None:
    """d2t must map into the target vocabulary, and t2d must mark exactly the ids d2t reaches."""
    try:
        vocab = head.hot_vocab
    except ValueError as err:
        raise CheckpointError(f"{source}: tensor 'd2t' is not a valid draft-to-target map: {err}") from err
    if not torch.equal(vocab.t2d.to(head.t2d.device), head.t2d):
        raise CheckpointError(f"{source}: tensor 't2d' disagrees with 'd2t' (t2d must be True exactly at i + d2t[i])")


def save_eagle3(head: Eagle3Head, path: str | Path) -> None:
    """Writes the EAGLE-3 directory layout: config.json + model.safetensors (no embedding). The config names the
    weights' dtype: SGLang reads a config without one as float32, and serves that as float16. A head whose residual
    is normed (`norm_before_residual`, vLLM's variant) goes to `export_speculators`: SGLang ignores the flag."""
    if head.config.norm_before_residual:
        raise ValueError("a head with norm_before_residual is served by vLLM alone: write it with export_speculators")
    config = head.config.to_hf() | {"torch_dtype": str(head.fc.weight.dtype).removeprefix("torch.")}
    _write_head_dir(path, config, _saved_state(head))


def export_speculators(
    head: Eagle3Head,
    path: str | Path,
    *,
    verifier: str,
    verifier_architectures: list[str],
    speculative_tokens: int = 3,
) -> None:
    """Writes vLLM's speculators layout. `verifier` names the target (a path or hub id) for vLLM."""
    layer = head.config.to_hf()
    extras = {k: layer.pop(k) for k in ("draft_vocab_size", "target_hidden_size") if k in layer}
    layer.pop("architectures")
    for key in ("eagle_config", "eagle_aux_hidden_state_layer_ids"):  # the ids go at the top, as vLLM reads them
        layer.pop(key, None)
    aux = head.config.aux_layers
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "draft_vocab_size": extras["draft_vocab_size"],
        # vLLM's speculators path defaults this to True when absent; always write it.
        "norm_before_residual": head.config.norm_before_residual,
        "target_hidden_size": extras.get("target_hidden_size"),
        "torch_dtype": str(head.fc.weight.dtype).removeprefix("torch."),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{
                "proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                "verifier_accept_k": 1, "accept_tolerance": 0.0,
            }],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
    }
    if aux is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux)  # vLLM ids: the layers the streams enter
    _write_head_dir(path, config, {k.replace("midlayer.", "layers.0.", 1): v for k, v in _saved_state(head).items()})


def _saved_state(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """The head's tensors under the names its layout gives them; ValueError for a head an Engine has prepared for
    serving (its projections joined and norms folded, in place), whose tensors no loader reads."""
    state = head.state_dict()
    with torch.device("meta"):
        names = Eagle3Head(head.config).state_dict().keys()
    if state.keys() != names:
        raise ValueError("the head's tensors are not its layout's (an Engine joins its projections and folds its "
                         "norms in place): save a head before serving it")
    return state


def _write_head_dir(path: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """config.json and model.safetensors in `path` (made if missing). A sharded checkpoint there (the index and the
    shards it names) goes first: loaders read the index before model.safetensors, so its weights would be read."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        for shard in set(weight_map.values()) if isinstance(weight_map, dict) else ():
            if isinstance(shard, str) and Path(shard).name == shard:  # a file of this folder, never one elsewhere
                (path / shard).unlink(missing_ok=True)
        index.unlink()
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_safetensors(tensors, path / "model.safetensors")
