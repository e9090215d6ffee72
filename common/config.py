"""Typed configs of the target decoder and the draft heads, read from Hugging Face `config.json`.

Every field is checked at load: a field of the wrong type raises a `ConfigError` that names the
file and the field. Family differences (qkv bias, q/k norm) are resolved here, once, from
`model_type`; the model code reads only the resolved booleans.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration is malformed, or does not fit what it configures (a file, a mapping, an engine's settings for
    its models); the message names the source, the field or the setting."""


@contextlib.contextmanager
def errors_naming(source, what: str = "", error: type[ValueError] = ConfigError,
                  catch: tuple[type[Exception], ...] = (ValueError,)) -> Iterator[None]:
    """A library's refusal of `source` raised within (`catch`), whose message may name no file (transformers' of a
    directory without tokenizer files, gguf's "GGUF magic invalid"), re-raised as `error` naming it:
    "{source}: {what} ({the message's first line})", or "{source}: {the message}" without `what`."""
    try:
        yield
    except catch as err:
        raise error(f"{source}: {what} ({str(err).splitlines()[0]})" if what else f"{source}: {err}") from err


def _type_ok(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        (item,) = typing.get_args(annotation)[:1] or (Any,)
        return isinstance(value, (list, tuple)) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, annotation)


def _type_name(annotation: Any) -> str:
    """`int`, `list[float]`, `int | None`: an annotation as a recipe's author writes it."""
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def build_dataclass(cls: type, values: Mapping[str, Any], *, source: str):
    """Builds dataclass `cls` from `values`, checking each field's type against its annotation.

    `source` names where the values came from (a file, a recipe key) for error messages. Unknown keys are errors
    (readers of HF config.json files pick their fields first: `read_layer_fields`).
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {unknown}; known keys: {sorted(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name not in values:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{source}: missing required field '{name}'")
            continue
        value = values[name]
        if not _type_ok(value, hints[name]):
            raise ConfigError(
                f"{source}: field '{name}' should be {_type_name(hints[name])}, got {type(value).__name__} {value!r}"
            )
        if hints[name] is float and isinstance(value, int):
            value = float(value)
        kwargs[name] = value
    with errors_naming(source, catch=(ValueError, TypeError)):
        return cls(**kwargs)


def mapping_field(cfg: Mapping[str, Any], key: str, source: str) -> Mapping[str, Any]:
    """`cfg[key]`, a nested object of a config.json; {} when absent or null."""
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: field '{key}' should be an object, got {type(value).__name__} {value!r}")
    return value


def check_layer_sizes(config: Any, more: tuple[str, ...] = ()) -> None:
    """Raises a ValueError naming the first of `config`'s size fields (`LAYER_SIZES` and `more`) below 1 (a 0 would
    divide by zero or build empty layers far from the file that said it), or heads that no number of query heads
    per KV head gives."""
    for name in LAYER_SIZES + more:
        if getattr(config, name) < 1:
            raise ValueError(f"field '{name}' must be >= 1, got {getattr(config, name)}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"num_attention_heads ({config.num_attention_heads}) is not a multiple of "
                         f"num_key_value_heads ({config.num_key_value_heads})")


def read_json(path: str | Path) -> dict:
    path = Path(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON (line {err.lineno}, column {err.colno}): {err.msg}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return data


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: `theta` and an optional scaling rule (`default`, `linear` or `llama3`)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self):
        if self.type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope scaling type '{self.type}' is not supported (default, linear, llama3)")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], source: str) -> RopeConfig:
        # transformers < 5 writes `rope_theta` + `rope_scaling`; transformers 5 writes `rope_parameters`.
        params = {}
        for key in ("rope_parameters", "rope_scaling"):
            params.update(mapping_field(cfg, key, source))
        theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))  # rope_parameters' first, as transformers 5
        rope_type = params.pop("rope_type", params.pop("type", "default"))
        known = {f.name for f in dataclasses.fields(cls)}
        values = {"theta": theta, "type": rope_type, **{k: v for k, v in params.items() if k in known}}
        return build_dataclass(cls, values, source=f"{source} (rope)")

    def to_hf(self) -> dict[str, Any]:
        """The `rope_theta` / `rope_scaling` pair of a config.json (the layout every engine reads)."""
        if self.type == "default":
            return {"rope_theta": self.theta, "rope_scaling": None}
        scaling: dict[str, Any] = {"rope_type": self.type, "factor": self.factor}
        if self.type == "llama3":
            scaling.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return {"rope_theta": self.theta, "rope_scaling": scaling}


def read_layer_fields(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The Llama decoder-layer fields of an HF config.json (targets and heads alike), with HF's defaults:
    `num_key_value_heads` = heads, `head_dim` = hidden / heads. Types are checked by `build_dataclass`."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":  # every layer here computes SiLU
        raise ConfigError(f"{source}: field 'hidden_act' is {act!r}; only 'silu' is supported")
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    values = {k: cfg[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "rms_norm_eps",
        "max_position_embeddings",
    ) if k in cfg}
    kv_heads = cfg.get("num_key_value_heads")
    values["num_key_value_heads"] = heads if kv_heads is None else kv_heads
    if cfg.get("head_dim") is not None:
        values["head_dim"] = cfg["head_dim"]
    elif isinstance(hidden, int) and isinstance(heads, int) and heads:
        values["head_dim"] = hidden // heads
    values["rope"] = RopeConfig.from_hf(cfg, source)
    return values


# The size fields `read_layer_fields` reads, each at least 1.
LAYER_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "max_position_embeddings")


def write_layer_fields(c: Any) -> dict[str, Any]:
    """The inverse of `read_layer_fields` for a config object carrying those fields (the heads' config.json)."""
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        **c.rope.to_hf(),
    }


# Family traits by HF `model_type`: the only place that looks at the name.
#   qkv_bias: q/k/v projections have a bias; o_bias: o_proj has one; qk_norm: RMSNorm on q and k per head.
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}


@dataclass(frozen=True)
class TargetConfig:
    """A Llama-family decoder (Llama 3.x, Qwen2/2.5, Qwen3, Mistral), as its config.json describes it."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self):
        check_layer_sizes(self, ("num_hidden_layers",))

    @property
    def causal_lm_class(self) -> str:
        """This family's causal LM class in transformers, named after its model_type (`LlamaForCausalLM`,
        `Qwen2ForCausalLM`, ...): what a checkpoint without config.json (a GGUF file) stands for."""
        return f"{self.model_type.capitalize()}ForCausalLM"

    @property
    def default_aux_layers(self) -> tuple[int, int, int]:
        """Layers whose *input* residual stream EAGLE-3 fuses: [2, L//2, L-3] (DESIGN, 'Aux hidden states')."""
        n = self.num_hidden_layers
        return (2, n // 2, n - 3)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], source: str = "config.json") -> TargetConfig:
        cfg = dict(cfg)
        cfg.update(mapping_field(cfg, "text_config", source))  # multimodal wrappers nest the decoder's fields
        architecture = (cfg.get("architectures") or [""])[0]
        if "eagle" in str(architecture).lower() or "speculators_model_type" in cfg or "draft_vocab_size" in cfg:
            raise ConfigError(f"{source}: a draft head's config (architectures {cfg.get('architectures')}), not a "
                              "target model's: a head is given as the draft (--draft, model.init_from)")
        model_type = cfg.get("model_type")
        if model_type not in _FAMILIES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; supported: {sorted(_FAMILIES)}"
            )
        values = read_layer_fields(cfg, source)
        values.update({k: cfg[k] for k in ("num_hidden_layers", "tie_word_embeddings", "mlp_bias") if k in cfg})
        values["model_type"] = model_type
        bias = cfg.get("attention_bias", False)
        values.update(qkv_bias=bias, o_bias=bias)
        values.update(_FAMILIES[model_type])
        # Within a sliding window attention is plain causal attention: cap the context there, where a layer slides.
        window = _sliding_window(cfg, model_type)
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ConfigError(f"{source}: field 'sliding_window' should be a positive integer or null, got {window!r}")
        if window is not None and isinstance(values.get("max_position_embeddings"), int):
            values["max_position_embeddings"] = min(values["max_position_embeddings"], window)
        return build_dataclass(cls, values, source=source)

    @classmethod
    def from_json(cls, path: str | Path) -> TargetConfig:
        return cls.from_hf(read_json(path), source=str(path))


def _sliding_window(cfg: Mapping[str, Any], model_type: str) -> Any:
    """The window of a config's sliding layers, or None where no layer slides, as transformers 5 reads the config:
    Mistral slides every layer (a window of 4096 where the field is absent; no switch); Qwen2/Qwen3 only with
    use_sliding_window, and then the layers `layer_types` marks, by default those from max_window_layers (28) on;
    Llama never."""
    if model_type == "mistral":
        return cfg.get("sliding_window", 4096)
    if model_type not in ("qwen2", "qwen3") or not cfg.get("use_sliding_window", False):
        return None
    types, layers = cfg.get("layer_types"), cfg.get("num_hidden_layers")  # a bad layer count: build_dataclass names it
    slides = "sliding_attention" in types if types else isinstance(layers, int) and layers > cfg.get(
        "max_window_layers", 28)
    return cfg.get("sliding_window", 4096) if slides else None
