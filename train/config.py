"""Training recipes: small typed dataclasses per concern, composed into `TrainRecipe`, read from YAML.

A recipe file maps one-to-one onto the dataclasses (sections = fields that are dataclasses):

    model: {target: /models/Llama-3.1-8B-Instruct, draft_vocab_size: 32000}
    optim: {lr: 1.0e-4, total_steps: 20000, warmup_steps: 500}
    deepspeed: {zero_stage: 2}

    recipe = load_recipe("ci-tiny", ["optim.lr=3e-4", "checkpoint.every=2"])

An unknown or mistyped key is a `ConfigError` naming the file and the dotted key. `--set` values are
parsed with the same YAML scalar rules as the file (`3e-4` is a float, `null` is None, `[1, 2]` a list).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eyas.common.architectures import ARCHITECTURES
from eyas.common.config import ConfigError, build_dataclass
from eyas.data import dataset

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


@dataclass(frozen=True)
class RandomTarget:
    """A random Llama target built in-process (CI and tests): no checkpoint needed."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    seed: int = 0


@dataclass(frozen=True)
class ModelConfig:
    target: str | None = None  # a local HF directory, a .gguf file or a packaged model (smollm2-135m-instruct)
    random_target: RandomTarget | None = None
    random_arch: str | None = None  # a named architecture (eyas.common.architectures) with random weights: benchmarks
    draft_vocab_size: int = 32000  # capped at the target's vocab
    aux_layers: list[int] | None = None  # layers the fused streams enter; None: [2, L//2, L-3]
    init_from_target: bool = True  # lm_head rows and final norm copied from the target (trainer.init_from_target)
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU), bf16 or fp32

    def __post_init__(self):
        if sum(x is not None for x in (self.target, self.random_target, self.random_arch)) != 1:
            raise ValueError("set exactly one of 'target', 'random_target' and 'random_arch'")
        if self.random_arch is not None and self.random_arch not in ARCHITECTURES:
            raise ValueError(f"random_arch {self.random_arch!r} is not one of {sorted(ARCHITECTURES)}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be auto, bf16 or fp32, got {self.precision!r}")


@dataclass(frozen=True)
class SyntheticData:
    """Random token rows (CI); every row is a full row, the last `1 - assistant_fraction` of it unmasked."""

    num_batches: int = 8
    batch_size: int = 2
    seq_len: int = 32
    assistant_fraction: float = 0.5
    seed: int = 0


@dataclass
class DataConfig(dataset.DataConfig):
    """Conversations (a file, or a packaged data set such as `sharegpt`) or synthetic rows. The inherited
    fields (max_length, format, num_proc, cache_dir, max_bytes) say how `eyas.data.dataset.build_dataset` reads
    and tokenizes the file.

    With `hidden_states` (offline training), `train-eagle --dump-hidden-states` runs the whole target once over
    these rows and writes its hidden states there; training then reads them, row for row, instead of running
    the target, of which it loads only the embedding, final norm and lm_head."""

    path: str | None = None  # a ShareGPT JSON / messages JSONL / UltraChat file, or a packaged asset name
    synthetic: SyntheticData | None = None
    hidden_states: str | None = None  # offline: a directory of dumped hidden states (eyas.data.hidden_states)
    tokenizer: str | None = None  # a target path or packaged model name; None: the target's (needed for random_target)
    max_conversations: int | None = None  # keep at most this many rows (the first, after tokenizing)
    eval_fraction: float = 0.0  # rows held out for evaluation (a seeded random choice)
    batch_size: int = 1  # rows per micro-batch, grouped by similar length
    bucket: int = 32  # length-sort windows of `bucket` micro-batches each, to keep padding low
    pad_multiple: int = 1  # pad micro-batches to a multiple of this length: CPU bf16 kernels are built per shape

    def __post_init__(self):
        super().__post_init__()
        if self.path is not None and self.synthetic is not None:
            raise ValueError("set at most one of 'path' and 'synthetic'")
        if not 0 <= self.eval_fraction < 1 or min(self.batch_size, self.bucket, self.pad_multiple) < 1:
            raise ValueError("need 0 <= eval_fraction < 1 and batch_size, bucket, pad_multiple >= 1")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-4
    min_lr: float = 0.0  # the cosine decays to this
    warmup_steps: int = 0
    total_steps: int = 1000  # optimizer steps; the data repeats as needed
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 0.5  # max global grad norm; 0 disables
    grad_accum: int = 1  # micro-batches per optimizer step

    def __post_init__(self):
        if self.total_steps < 1 or self.grad_accum < 1 or not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError("need total_steps >= 1, grad_accum >= 1 and 0 <= warmup_steps <= total_steps")


@dataclass(frozen=True)
class TTTConfig:
    steps: int = 7  # training-time-test unroll depth
    decay: float = 0.8  # step i's loss weighs decay**i


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # optimizer steps between checkpoints; 0: none
    keep_last: int = 0  # delete older checkpoints beyond this many; 0: keep all
    resume: bool = True  # continue from the latest checkpoint under <output>/checkpoints
    stop_after: int | None = None  # exit after this step without exporting (a preemption drill)


@dataclass(frozen=True)
class LoggingConfig:
    progress: bool = True  # tqdm bar on rank 0
    wandb_project: str | None = None  # None: no wandb
    wandb_mode: str = "offline"
    run_name: str | None = None
    eval_every: int = 0  # optimizer steps between held-out evaluations (also before the first and after the last)


@dataclass(frozen=True)
class DeepSpeedConfig:
    zero_stage: int = 1  # 0-3; 3 also partitions the head's parameters (gathered in each forward and at export)
    extra: dict = field(default_factory=dict)  # merged last into the generated DeepSpeed config (optim.py)

    def __post_init__(self):
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")


@dataclass(frozen=True)
class TrainRecipe:
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ttt: TTTConfig = field(default_factory=TTTConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `3e-4` as a string (it wants `3.0e-4`); accept exponents without a dot as floats."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$"),
    list("-+0123456789."),
)
# Plain integers must still resolve as int: the int resolver is tried first only if registered first.
_Loader.yaml_implicit_resolvers = {
    k: sorted(v, key=lambda r: r[0] != "tag:yaml.org,2002:int") for k, v in _Loader.yaml_implicit_resolvers.items()
}


def parse_scalar(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def _section_type(annotation: Any) -> type | None:
    """The dataclass of a section field (`X` or `X | None`), else None."""
    candidates = typing.get_args(annotation) or (annotation,)
    return next((a for a in candidates if dataclasses.is_dataclass(a)), None)


def _build(cls: type, values: Any, source: str, prefix: str):
    where = prefix or "the top level"
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: '{where}' should be a mapping, got {type(values).__name__} {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in names:
            dotted = f"{prefix}.{key}" if prefix else key
            raise ConfigError(f"{source}: unknown key '{dotted}'; known keys of {where}: {names}")
    built = dict(values)
    for name, value in values.items():
        section = _section_type(hints[name])
        if section is not None and value is not None:
            built[name] = _build(section, value, source, f"{prefix}.{name}" if prefix else name)
    return build_dataclass(cls, built, source=f"{source}: {where}")


def recipe_path(recipe: str | Path) -> Path:
    """A path, or the name of a file in recipes/ (`ci-tiny` -> recipes/ci-tiny.yaml)."""
    path = Path(recipe)
    if path.exists():
        return path
    named = RECIPES_DIR / f"{recipe}.yaml"
    if named.exists():
        return named
    known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    raise FileNotFoundError(f"recipe {recipe!r}: no such file, nor a recipe in {RECIPES_DIR} (known: {known})")


def apply_overrides(values: dict, overrides: list[str]) -> dict:
    """`["optim.lr=3e-4", ...]` applied to a nested dict (a copy); the value is a YAML scalar."""
    values = dict(values)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
        *parents, leaf = key.split(".")
        node = values
        for i, part in enumerate(parents):
            child = node.get(part) if part in node else {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: '{'.'.join(parents[: i + 1])}' is not a section")
            node[part] = child = dict(child)
            node = child
        try:
            node[leaf] = parse_scalar(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"--set {key}: value {text!r} is not a YAML scalar: {err}") from err
    return values


def recipe_from_dict(values: dict, source: str = "recipe") -> TrainRecipe:
    return _build(TrainRecipe, values, source, "")


def load_recipe(recipe: str | Path, overrides: list[str] = ()) -> TrainRecipe:
    path = recipe_path(recipe)
    try:
        values = yaml.load(path.read_text(), Loader=_Loader) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    source = str(path) + (f" (with --set {' '.join(overrides)})" if overrides else "")
    return recipe_from_dict(apply_overrides(values, list(overrides)), source)
