"""`train-eagle`: train an EAGLE-3 head from a recipe.

    train-eagle --recipe ci-tiny --output runs/ci-tiny                       # one process (CPU or one GPU)
    train-eagle --recipe recipes/my-target.yaml --set optim.lr=3e-4 --set checkpoint.every=500 --output runs/x
    deepspeed --num_gpus 8 --module eyas.train.cli --recipe recipes/my-target.yaml --output runs/x   # 8 GPUs

`--recipe` is a YAML path or the name of a file in recipes/; each `--set dotted.key=value` overrides one
field (YAML scalar syntax). Rerunning the same command resumes from the latest checkpoint in --output. SIGTERM or
SIGINT (preemption, `timeout`, Ctrl-C) stops training after the step in progress and checkpoints it first; the exit
status is then the signal's (143, 130), as for a killed process: the run is unfinished.

Offline hidden states (a recipe with `data.hidden_states: DIR`): first dump them, once, in one process on one
device that holds the whole target; rerun the same command to resume an interrupted dump. Training then reads
DIR and loads only the target's embedding, final norm and lm_head:

    train-eagle --recipe R --set data.hidden_states=/data/states --dump-hidden-states
    deepspeed --num_gpus 8 --module eyas.train.cli --recipe R --set data.hidden_states=/data/states --output runs/x
"""

from __future__ import annotations

import argparse
import sys

import torch.distributed as dist

from eyas.common.cli import HelpFormatter
from eyas.common.config import ConfigError

from .checkpoint import Stopped
from .config import load_recipe


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="train-eagle", description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--recipe", required=True, help="a YAML path or a name in recipes/")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe field, e.g. optim.lr=3e-4 (repeatable)")
    parser.add_argument("--output", help="run directory (metrics, checkpoints, final head); needed to train")
    parser.add_argument("--dump-hidden-states", action="store_true",
                        help="instead of training, run the whole target over the recipe's data and write its hidden "
                        "states into the recipe's data.hidden_states, for training from them later (offline)")
    # The deepspeed launcher passes --local_rank; the rank is read from the environment instead.
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.dump_hidden_states and args.output is None:
        parser.error("--output is required (except with --dump-hidden-states)")
    if args.dump_hidden_states and args.output is not None:
        parser.error("--dump-hidden-states writes into the recipe's data.hidden_states (--set data.hidden_states=DIR): "
                     "--output would be ignored")
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        from .trainer import dump, train  # DeepSpeed and the models: seconds that --help and a bad recipe need not pay
        if args.dump_hidden_states:
            dump(recipe)
        else:
            train(recipe, args.output)
    except ConfigError as err:  # a bad recipe or config.json: its message names the key; a traceback adds nothing
        parser.error(str(err))
    except Stopped as stopped:  # checkpointed, and said so: the status tells a retry loop the run is unfinished
        sys.exit(stopped.exit_status)
    except KeyboardInterrupt:  # Ctrl-C before training started (loading): nothing to checkpoint, nothing to show
        print("train-eagle: interrupted before training started", file=sys.stderr)
        sys.exit(130)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
