"""The EAGLE-3 trainer: frozen target (online or dumped hidden states) -> head unrolled with training-time test ->
DeepSpeed.

    from eyas.train.config import load_recipe
    from eyas.train.trainer import dump, train
    train(load_recipe("ci-tiny"), "runs/ci-tiny")   # -> runs/ci-tiny/final (EAGLE-3 head directory)
    dump(recipe)        # offline: the target's hidden states over the recipe's rows -> data.hidden_states

One optimizer step = `optim.grad_accum` micro-batches per rank. Per micro-batch: the target runs without
gradient and yields the residual streams entering `aux_layers` ([B, T, 3·Ht]) and its logits ([B, T, V]), or,
with `data.hidden_states`, they are read from the states `dump` wrote there (train.target); `ttt_loss` unrolls the
head over them; DeepSpeed owns backward, accumulation, clipping, the ZeRO-partitioned AdamW step (ZeRO-3 also
partitions the head's parameters) and the warmup + cosine schedule. Data: `data.path` (tokenized conversations,
train.data) or `data.synthetic`; with `data.eval_fraction`, the held-out rows are evaluated before training, every
`logging.eval_every` steps and at the end. Outputs under `<output>/`:

    recipe.yaml          the recipe as run
    metrics.jsonl        one line per optimizer step, one per held-out evaluation (train.metrics)
    checkpoints/step_N/  every `checkpoint.every` steps (train.checkpoint), and at the step SIGTERM or SIGINT
                         stopped the run (`StopSignal`); a rerun resumes from the latest
    final/               the head, SGLang/vLLM EAGLE-3 layout (save_eagle3), and eval.json: its held-out metrics
    final-speculators/   the head, vLLM speculators layout
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import yaml
from deepspeed.accelerator import get_accelerator
from torch import Tensor, nn
from tqdm import tqdm

from eyas.common.assets import model_source, resolve_target
from eyas.common.checkpoint import gguf_parsed_once
from eyas.common.config import ConfigError, TargetConfig, read_json
from eyas.common.eagle3 import Eagle3Config, Eagle3Head
from eyas.common.head_checkpoint import export_speculators, load_draft_head, save_eagle3
from eyas.common.hot_vocab import HotVocab
from eyas.common.layers import use_kernels
from eyas.common.target import TargetModel, default_dtype
from eyas.data.hidden_states import HiddenStateDataset, check_dumped, dump_hidden_states, target_fingerprint

from . import checkpoint
from .batches import Batch, micro_batches
from .config import ModelConfig, TrainRecipe
from .data import TrainData, check_fits_context, data_inputs, load_data, load_rows
from .metrics import MetricsLog
from .optim import build_optimizer, deepspeed_config, resume_schedule
from .target import load_target, target_config_of, target_states
from .ttt import TTTOutput, acceptance_length, training_kernels, ttt_loss


class TTTModule(nn.Module):
    """What DeepSpeed wraps: the head, with the training-time-test loss as its forward. The target's
    embedding is an argument, not a submodule, so DeepSpeed neither casts, partitions nor saves it."""

    def __init__(self, head: Eagle3Head, steps: int, decay: float):
        super().__init__()
        self.head, self.steps, self.decay = head, steps, decay

    def forward(self, embed: Tensor, input_ids: Tensor, aux: Tensor, target_logits: Tensor, loss_mask: Tensor,
                attention_mask: Tensor) -> TTTOutput:
        return ttt_loss(self.head, embed, input_ids, aux, target_logits, loss_mask, attention_mask,
                        steps=self.steps, decay=self.decay)


class StopSignal:
    """While entered, SIGTERM or SIGINT (preemption, `timeout`, Ctrl-C) only sets `name`, so that training can finish
    its optimizer step and checkpoint it. After the first, a second SIGINT kills at once (Ctrl-C twice), while
    SIGTERM keeps being recorded only: launchers (torchrun, deepspeed) forward a SIGTERM to workers that Ctrl-C
    reached already. Leaving restores the handlers found on entry (`train` runs in-process in tests and notebooks)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.name: str | None = None  # the signal received, e.g. "SIGTERM"
        self._previous: dict = {}

    def _handle(self, signum: int, frame) -> None:
        self.name = self.name or signal.Signals(signum).name
        if signal.SIGINT in self._previous:
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():  # Python runs handlers only there
            # An ignored signal stays ignored (e.g. SIGINT of `train-eagle ... &` in a shell script).
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS
                              if signal.getsignal(s) is not signal.SIG_IGN}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)  # None: not set from Python


def head_config(cfg: ModelConfig, target: TargetConfig) -> Eagle3Config:
    """The head a recipe trains: shaped like one target layer, over `model.draft_vocab_size` tokens (capped at the
    target's vocab, as the draft vocabulary is), fusing the streams entering `model.aux_layers` (None: the default
    [2, L//2, L-3], which the exported config then leaves implicit)."""
    aux = tuple(cfg.aux_layers) if cfg.aux_layers is not None else None
    if aux == target.default_aux_layers:  # left implicit, as every engine reads it (DESIGN, "Aux hidden states")
        aux = None
    config = Eagle3Config.for_target(target, min(cfg.draft_vocab_size, target.vocab_size), aux_layers=aux)
    try:
        config.aux_layers_for(target)
    except ValueError as err:
        raise ConfigError(f"model.aux_layers: {err}") from err
    return config


def build_head(config: Eagle3Config, target: TargetModel, hot: HotVocab | None, cfg: ModelConfig) -> Eagle3Head:
    """A head of `config` (`head_config`) whose draft vocabulary is `hot`. None: the vocabulary comes from elsewhere,
    `cfg.init_from`'s head or, when resuming, the checkpoint loaded next (which sets every weight: no init here).

    With `cfg.init_from`, the head of an earlier run (its `final/`) is trained further: its weights and its draft
    vocabulary (the lm_head rows keep their tokens). Refused unless shaped as `config`. Else, with
    `cfg.init_from_target`, the parts whose meaning the target fixes start from it: lm_head row i = the target's
    lm_head row of token hot_ids[i], and the final norm = the target's final norm (the head's output plays the role
    of the target's last residual stream). The rest (fc, the layer) is PyTorch's default init: there is no target
    counterpart of their 2H/3H-wide inputs."""
    if cfg.init_from is not None:
        head = load_draft_head(cfg.init_from, dtype=torch.float32)
        if not isinstance(head, Eagle3Head):
            raise ConfigError(f"model.init_from {cfg.init_from}: not an EAGLE-3 head")
        if head.config != config:
            differ = [f"{f.name} {getattr(head.config, f.name)} (recipe: {getattr(config, f.name)})"
                      for f in dataclasses.fields(config) if getattr(head.config, f.name) != getattr(config, f.name)]
            raise ConfigError(f"model.init_from {cfg.init_from}: the head differs from the recipe's: "
                              + ", ".join(differ))
        return head.train()
    head = Eagle3Head(config)
    if hot is None:
        return head
    head.set_hot_vocab(hot)
    if cfg.init_from_target:
        with torch.no_grad():
            rows = hot.hot_ids.to(target.lm_head_weight.device)
            head.lm_head.weight.copy_(target.lm_head_weight.index_select(0, rows))
            head.norm.weight.copy_(target.model.norm.weight)
    return head


def _init_distributed() -> tuple[int, int, int]:
    """(rank, local rank, world size). Without a launcher (`train-eagle`, tests) this is a world of one."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed()
    return dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0)), dist.get_world_size()


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _atomic_export(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    checkpoint.durable_replace(tmp, path)


def _verifier_architectures(cfg: ModelConfig, target: TargetConfig) -> list[str]:
    """The target's classes as its config.json names them; without one (a .gguf file, a random target), its
    family's causal LM."""
    config = resolve_target(cfg.target) / "config.json" if cfg.target else None
    named = read_json(config).get("architectures") if config is not None and config.is_file() else None
    return named or [target.causal_lm_class]


def _dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(cfg.precision) or default_dtype(device)
    if dtype == torch.bfloat16 and device.type == "cpu" and (slower := _bf16_slowdown()) > 4:
        tqdm.write(f"train-eagle: model.precision bf16 on this CPU: its bf16 matmuls run {slower:.0f}x slower than "
                   "fp32 ones (no native bf16, e.g. AVX2 without AVX-512 BF16); model.precision=fp32 trains faster")
    return dtype


def _bf16_slowdown() -> float:
    """How many times longer a bf16 matmul takes than an fp32 one on this CPU (best of 3 each, 0.1 s or so): a CPU
    without bf16 instructions takes 50-60 times longer (54x and 59.8x measured, docs/results.md)."""
    def seconds(dtype):
        a = torch.ones(256, 256, dtype=dtype)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - start)
        return min(times)

    return seconds(torch.bfloat16) / seconds(torch.float32)


def _prepare_data(recipe: TrainRecipe, target: TargetModel, aux_layers: tuple[int, ...], rank: int) -> TrainData:
    """The recipe's rows, split and batched (rank 0 fills `datasets`' cache first, the other ranks then read it);
    offline, the batches read the hidden states dumped for them (refused if dumped from another target)."""
    if rank != 0:
        dist.barrier()
    vocab_size = target.config.vocab_size
    rows = load_rows(recipe, vocab_size)
    if rank == 0:
        dist.barrier()
    path = recipe.data.hidden_states
    states = HiddenStateDataset(path, target, aux_layers) if path is not None else None
    return load_data(recipe.data, rows, vocab_size, recipe.model.draft_vocab_size, recipe.seed, states)


def _summary(totals: Tensor, steps: int, micro_batches: int) -> dict:
    """totals = [Σ loss, correct per unroll step [k], counted per unroll step [k]] summed over micro-batches."""
    acc = (totals[1 : 1 + steps] / totals[1 + steps :].clamp(min=1)).tolist()
    return {"loss": float(totals[0]) / max(micro_batches, 1), "acc": acc,
            "tau": float(acceptance_length(torch.tensor(acc))),
            "tokens": int(totals[1 + steps])}


def _totals(out: TTTOutput) -> Tensor:
    count = out.per_step_count.double()
    return torch.cat([out.loss.detach().double()[None], out.per_step_acc.double() * count, count])


@torch.no_grad()
def evaluate(module: TTTModule, target: TargetModel, batches: Sequence[Batch], aux_layers: tuple[int, ...],
             rank: int, world_size: int) -> dict:
    """Per-step accuracy, τ and loss of the head on held-out batches (split over ranks), as `_summary` gives.

    Every rank runs as many forwards (ZeRO-3 gathers the head's parameters collectively in each): in the last
    round, a rank left without a batch reruns one and drops its result."""
    device = target.embed_tokens.weight.device
    totals = torch.zeros(1 + 2 * module.steps, dtype=torch.float64, device=device)
    for j in range(rank, math.ceil(len(batches) / world_size) * world_size, world_size):
        batch = {k: v.to(device) for k, v in batches[j % len(batches)].items()}
        aux, logits = target_states(target, batch, aux_layers)
        out = module(target.embed_tokens.weight, batch["input_ids"], aux, logits, batch["loss_mask"],
                     batch["attention_mask"])
        if j < len(batches):
            totals += _totals(out)
    if world_size > 1:
        dist.all_reduce(totals)
    return _summary(totals, module.steps, len(batches))


# A training step's `torch.profiler` range (`python -m eyas.train.bench --profile` reads it).
STEP_RANGE = "eyas.train_step"


def check_inputs(recipe: TrainRecipe, resuming: bool = False) -> None:
    """What can be checked before the target loads (minutes for a 70B one): that the target, the head to train
    further (unless `resuming`, which does not read it), the tokenizer and the data's sources exist, that the rows fit
    the target's context and the aux layers its layers. Each failure is a `ConfigError` naming the recipe key."""
    target = target_config_of(recipe.model)
    head_config(recipe.model, target)
    check_fits_context(recipe.data, target.max_position_embeddings)
    init_from = recipe.model.init_from
    if init_from is not None and not resuming and not Path(init_from).is_dir():
        raise ConfigError(f"model.init_from {init_from}: no such directory (a run's final/ to train further)")
    if recipe.data.synthetic is None:
        data_inputs(recipe)


def _check_training_run(output: Path, found: list[Path], recipe: TrainRecipe) -> None:
    """What a training run (not a dump) needs, checked before the target loads: `output` a directory to write, not
    one holding a finished run that no checkpoint resumes (it would be trained again from step 0 and its head, recipe
    and metrics replaced); the dumped hidden states it reads; wandb where it logs there."""
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {output}: a file, not a run directory")
    if not found and (output / "final").exists():
        raise ConfigError(f"--output {output}: holds a finished run (final/) and no checkpoint to resume: train into "
                          "another --output, or remove that one")
    if recipe.data.hidden_states is not None:
        try:
            check_dumped(recipe.data.hidden_states)
        except ConfigError as err:
            raise ConfigError(f"data.hidden_states {err}") from None
    if recipe.logging.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb_project is set but wandb is not installed: pip install 'eyas[wandb]'")


def _data_order(recipe: TrainRecipe, world_size: int) -> dict:
    """The settings a checkpoint's data position and step count depend on: its data, seed and world size decide which
    rows a position means; gradient accumulation, how many positions a step took. Not the worker count, cache
    directory, padding or where the hidden states were dumped (the rows are checked by their digest)."""
    data = {f"data.{key}": value for key, value in recipe.to_dict()["data"].items()
            if key not in ("num_proc", "cache_dir", "pad_multiple", "hidden_states")}
    return data | {"seed": recipe.seed, "optim.grad_accum": recipe.optim.grad_accum, "world_size": world_size}


def _optimizer_settings(recipe: TrainRecipe) -> dict:
    """The settings a checkpoint's optimizer and lr schedule states hold, which loading them restores: the peak lr
    (the schedule's base), betas and weight decay; and the ZeRO stage, which lays those states out (DeepSpeed fails
    on another's files). The schedule's shape (warmup, min_lr, total_steps) stays the recipe's."""
    return ({f"optim.{key}": getattr(recipe.optim, key) for key in ("lr", "betas", "weight_decay")}
            | {"deepspeed.zero_stage": recipe.deepspeed.zero_stage})


@gguf_parsed_once()  # a GGUF target's config, weights and tokenizer, read from one parse of its file
def train(recipe: TrainRecipe, output: str | Path) -> Path | None:
    """Trains a head as `recipe` says; returns `<output>/final`, or None when `checkpoint.stop_after` stopped it.
    SIGTERM or SIGINT stop it after the step in progress, checkpointed (rerunning resumes there), and raise
    `checkpoint.Stopped`."""
    output = Path(output)
    rank, local_rank, world_size = _init_distributed()
    ckpt_root = output / "checkpoints"
    found = checkpoint.checkpoints(ckpt_root)
    if found and not recipe.checkpoint.resume:
        raise ConfigError(f"{ckpt_root}: holds {found[-1].name} of an earlier run and checkpoint.resume is false: "
                          "resume it, or train into another --output")
    _check_training_run(output, found, recipe)
    data_order, optimizer_settings = _data_order(recipe, world_size), _optimizer_settings(recipe)
    if found:
        checkpoint.check_resumable(found[-1], data_order, recipe.optim.total_steps)
        checkpoint.check_same(found[-1], "optimizer", optimizer_settings)
    check_inputs(recipe, resuming=bool(found))
    if rank == 0:  # a cut-short save's leftovers: `save` deletes them too, but this run may save no more
        checkpoint.remove_partial(ckpt_root)
    get_accelerator().set_device(local_rank)
    device = torch.device(get_accelerator().device_name(local_rank))
    dtype = _dtype(recipe.model, device)
    _seed(recipe.seed)
    started = time.perf_counter()

    target = load_target(recipe.model, dtype, device, layers=recipe.data.hidden_states is None)
    config = head_config(recipe.model, target.config)
    aux_layers = config.aux_layers_for(target.config)
    # What a checkpoint's weights and optimizer states fit: the head's config, its layers resolved, precision, and the
    # target whose states it learned from (another of the same shape, a base model for its instruct one, would load).
    precision = str(dtype).removeprefix("torch.")
    head_record = dataclasses.asdict(config) | {"aux_layers": aux_layers, "precision": precision,
                                                "target": target_fingerprint(target)}
    if found:
        checkpoint.check_same(found[-1], "head", head_record)
    data = _prepare_data(recipe, target, aux_layers, rank)
    if found:
        checkpoint.check_same_rows(found[-1], data.rows_record)
    batches, eval_batches = data.train, data.eval
    # A checkpoint holds the whole head, vocabulary included: resuming reads neither model.init_from again nor this
    # run's vocabulary. A head trained further keeps its own. Either way this run's vocabulary is not counted.
    model = dataclasses.replace(recipe.model, init_from=None) if found else recipe.model
    head = build_head(config, target, None if found or model.init_from else data.hot, model)
    use_kernels(head, training_kernels(device))
    module = TTTModule(head, recipe.ttt.steps, recipe.ttt.decay)
    optimizer, schedule = build_optimizer(recipe, module)
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=optimizer, lr_scheduler=schedule,
        config=deepspeed_config(recipe, batches.micro_batch_size, bf16=dtype == torch.bfloat16),
    )

    step, position = 0, 0
    if found:
        state = checkpoint.load(engine, found[-1])
        step, position = state["step"], state["position"]
        resume_schedule(schedule, step)
        if rank == 0:
            tqdm.write(f"train-eagle: resuming from {found[-1]} (step {step} of {recipe.optim.total_steps})")
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        (output / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        log = MetricsLog(output / "metrics.jsonl", recipe.logging, recipe.to_dict(), resume_step=step,
                         final_step=recipe.optim.total_steps)

    def run_eval() -> dict:
        result = {"step": step, "split": "eval"} | evaluate(engine.module, target, eval_batches, aux_layers, rank,
                                                              world_size)
        if rank == 0:
            log.log(result)
            tqdm.write(f"eval step {step}: tau {result['tau']:.3f} acc {[round(a, 3) for a in result['acc']]}")
        return result

    if eval_batches is not None and step == 0:
        run_eval()  # the untrained head: the baseline
    bar = tqdm(total=recipe.optim.total_steps, initial=step, disable=rank != 0 or not recipe.logging.progress,
               desc="train-eagle")

    stream = micro_batches(batches, position, rank, world_size)
    embed = target.embed_tokens.weight
    steps = recipe.ttt.steps
    seen = 0  # real tokens through the target in this process
    signalled = False  # set when a rank got SIGTERM or SIGINT: stop after this step, checkpointed
    # Installed only for the steps: a signal while loading, evaluating the baseline or exporting loses no step, so
    # it still kills at once.
    with StopSignal() as stop:
        while step < recipe.optim.total_steps:
            step_started = time.perf_counter()
            # Sums over this optimizer step's micro-batches: loss, then per unroll step correct and counted tokens.
            totals = torch.zeros(1 + 2 * steps, dtype=torch.float64, device=device)
            lr = schedule.get_last_lr()[0]  # the lr of this step's update (the schedule advances after it)
            # The range ends with the step's one wait for the device, so the step's kernels all run inside it.
            with torch.profiler.record_function(STEP_RANGE):
                for _ in range(recipe.optim.grad_accum):
                    position, batch = next(stream)
                    position += 1
                    seen += int(batch["attention_mask"].sum())  # on the host copy: no wait for the device
                    batch = {k: v.to(device) for k, v in batch.items()}
                    aux, logits = target_states(target, batch, aux_layers)
                    out = engine(embed, batch["input_ids"], aux, logits, batch["loss_mask"], batch["attention_mask"])
                    engine.backward(out.loss)
                    engine.step()
                    totals += _totals(out)
                # + 1 element: how many ranks were signalled. It rides on the metrics' all-reduce, so every rank
                # agrees to stop after the same step without a collective of its own.
                totals = torch.cat([totals, totals.new_tensor([stop.name is not None])])
                if world_size > 1:
                    dist.all_reduce(totals)
                totals = totals.cpu()  # the metrics and the flag are read on the host
            step += 1
            totals, signalled = totals[:-1], bool(totals[-1])
            summary = _summary(totals, steps, recipe.optim.grad_accum * world_size)
            grad_norm = engine.get_global_grad_norm()
            if rank == 0:
                log.log({
                    "step": step, "split": "train", "loss": summary["loss"],
                    "lr": lr, "grad_norm": None if grad_norm is None else float(grad_norm),
                    "acc": summary["acc"], "tau": summary["tau"], "tokens": summary["tokens"],
                    # wall time of the step (copying the metrics to the host synchronises the device)
                    "seconds": time.perf_counter() - step_started,
                })
                bar.update(1)
                bar.set_postfix(loss=f"{summary['loss']:.3f}", tau=f"{summary['tau']:.2f}")
            every = recipe.logging.eval_every
            if eval_batches is not None and every and step % every == 0 and step < recipe.optim.total_steps:
                run_eval()  # even when stopping: a resumed run does not redo this step's evaluation
            # The last step too: a final evaluation or export that fails is redone on rerun without training again.
            save_every = recipe.checkpoint.every
            saved = bool(save_every) and (step % save_every == 0 or step == recipe.optim.total_steps)
            if saved or signalled:
                records = {"data_order": data_order, "head": head_record, "optimizer": optimizer_settings,
                           "rows": data.rows_record}
                path = checkpoint.save(engine, ckpt_root, step, position, records, recipe.checkpoint.keep_last)
            if signalled:
                if rank == 0:
                    tqdm.write(f"train-eagle: stopped by {stop.name or 'a signal to another rank'} at step {step}; "
                               f"checkpoint saved to {path}; rerun the same command to resume")
                break
            if recipe.checkpoint.stop_after is not None and step >= recipe.checkpoint.stop_after:
                if rank == 0:
                    tqdm.write(f"train-eagle: stopped at step {step} as checkpoint.stop_after says; nothing exported")
                break
    bar.close()
    done = step == recipe.optim.total_steps and not signalled
    final_eval = run_eval() if done and eval_batches is not None else None
    if rank == 0:
        log.close()
        seconds = time.perf_counter() - started
        tqdm.write(f"train-eagle: ~{seen * world_size} tokens in {seconds:.0f} s since the start, loading and "
                   f"evaluation included ({seen * world_size / seconds:.1f} tokens/s)")
    if signalled:
        raise checkpoint.Stopped(stop.name or "SIGTERM")
    if not done:
        return None

    final, head = output / "final", engine.module.head
    # Under ZeRO-3 each rank holds a slice of each parameter: every rank joins in gathering the whole head
    # (a no-op at stages 0-2), rank 0 writes it.
    with deepspeed.zero.GatheredParameters(list(head.parameters())):
        if rank == 0:
            _atomic_export(final, functools.partial(_write_final, head, final_eval))
            _atomic_export(output / "final-speculators", lambda p: export_speculators(
                head, p, verifier=model_source(recipe.model.target) if recipe.model.target else "random-target",
                verifier_architectures=_verifier_architectures(recipe.model, target.config), speculative_tokens=steps,
            ))
    if world_size > 1:
        dist.barrier()
    return final


def _write_final(head, final_eval: dict | None, path: Path) -> None:
    """The exported head and, when the run ended with an evaluation, its eval.json beside it (one unit: both are
    flushed and swapped in together)."""
    save_eagle3(head, path)
    if final_eval is not None:
        (path / "eval.json").write_text(json.dumps(final_eval, indent=1) + "\n")


@gguf_parsed_once()
def dump(recipe: TrainRecipe) -> Path:
    """Offline training's first part (`train-eagle --dump-hidden-states`): runs the recipe's whole target once over
    its rows (train.data.load_rows) and writes the hidden states `train` then reads into `data.hidden_states`
    (layout: eyas.data.hidden_states). One process on one device; rerun after an interruption, it resumes."""
    if recipe.data.hidden_states is None:
        raise ConfigError("the dump writes into data.hidden_states: set it in the recipe or with --set "
                         "data.hidden_states=DIR")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("the dump runs in one process: start it with train-eagle, not a distributed launcher")
    check_inputs(recipe)
    device = torch.device(get_accelerator().device_name(0))
    target = load_target(recipe.model, _dtype(recipe.model, device), device)
    aux_layers = head_config(recipe.model, target.config).aux_layers_for(target.config)
    dump_hidden_states(target, load_rows(recipe, target.config.vocab_size), recipe.data.hidden_states, aux_layers)
    return Path(recipe.data.hidden_states)
