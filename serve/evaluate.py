"""eval-eagle: how well a draft head is accepted, and what it buys, on MT-bench, HumanEval or your prompts.

    eval-eagle --target smollm2-135m-instruct --draft runs/quickstart/final --bench mt-bench --output eval/
    eval-eagle --target T --draft D --bench humaneval --temperature 1 --num-steps 6 --topk 8 --num-draft-tokens 48
    eval-eagle --target T --draft D --bench prompts.jsonl        # {"prompt": str} or {"messages": [...]} per line

In-process: every question runs with speculation on (the given tree) and, in the same run, off, so the
speedup is measured, not assumed; on a GPU both engines warm up first, untimed (CUDA graphs, Triton compiles).
Against a running `serve-eagle` (`--endpoint URL`), acceptance comes from each response's `eyas` field (give the
server's `--num-steps`: it sizes the per-position statistics); give `--endpoint-off URL` (the same target with
`--speculative off`) for the speedup. MT-bench runs both turns; the second turn follows the model's own first
answer. No system message is added (the chat template's default applies), as in training. `--concurrency N` answers
N questions of a turn together: τ is the same (a faster way to measure it), tokens/s becomes throughput at that
concurrency.

Reports (`report.json`, `report.md`, `acceptance.png`, `tau.png` in --output):
  τ              tokens per verification, bonus token included: mean over all verifications of (accepted + 1)
  accept_rate[i] P(draft token i+1 accepted | tokens 1..i accepted), over the verifications that reached i
  reach[i]       fraction of verifications that accepted at least i+1 draft tokens
  tokens/s       output tokens over wall time, speculation on and off; speedup = on / off
  skipped        prompts refused (no room in the context to answer them), each with a warning; their
                 questions end there
  same_answers   share of the answers (turns) that speculation gave as the baseline did, where the run repeats
                 (greedy, or sampled with --seed): lossless speculation gives the same text up to floating-point
                 rounding. In bf16 on a GPU the verification's many-row kernels round otherwise than a plain step's
                 one-row ones, which moves an argmax at a near tie, or a draw near a token's edge, and the answer
                 goes on from there; a turn after a changed answer follows another conversation. On an H100,
                 SmolLM2 (bf16), a weak head, 30 MT-bench questions: 18.3% greedy, 0.0% at temperature 1;
                 random weights in float32: every answer the same (docs/perf.md, sixty-third entry)
Worked example: verifications accepting [2, 0, 3, 1] draft tokens -> τ = (3+1+4+2)/4 = 2.5;
reach = [3/4, 2/4, 1/4]; accept_rate = [3/4, 2/3, 1/2].
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm import tqdm

from eyas.common.assets import asset_path
from eyas.common.cli import HelpFormatter
from eyas.common.config import ConfigError
from eyas.data.conversations import Conversation, read_json_lines, text_of

from .clients import Client, EndpointClient, EndpointError, EngineClient
from .commands import (
    TOKEN_MAP_HELP,
    add_device_argument,
    add_engine_arguments,
    add_sampling_arguments,
    add_tree_arguments,
    engine_options,
    frozen_heap,
    given_flags,
    load_models_for,
    memory_fraction,
    refuse_unread,
    require_positive,
    sampling_params,
    tree_shape,
)
from .draft import TreeShape
from .engine import Engine, EngineConfig

log = logging.getLogger(__name__)


@dataclass
class Acceptance:
    tau: float | None  # None: no verification reported (speculation off, or an endpoint without `eyas` statistics)
    accept_rate: list[float]
    reach: list[float]
    verifications: int
    histogram: list[int]  # histogram[a]: verifications that accepted a draft tokens


def acceptance_stats(accepted: list[int], depth: int) -> Acceptance:
    """From per-verification accepted draft-token counts (each 0..depth); see the module docstring. An endpoint
    whose trees are deeper than `depth` (--num-steps) widens it to its deepest acceptance, with a warning."""
    if accepted and max(accepted) > depth:
        log.warning("a verification accepted %d draft tokens, more than --num-steps %d: the statistics cover %d "
                    "positions (pass the server's tree depth as --num-steps)", max(accepted), depth, max(accepted))
        depth = max(accepted)
    n = len(accepted)
    if n == 0:
        return Acceptance(None, [0.0] * depth, [0.0] * depth, 0, [0] * (depth + 1))
    at_least = [sum(a >= i for a in accepted) for i in range(depth + 1)]  # at_least[0] = n
    return Acceptance(
        tau=sum(a + 1 for a in accepted) / n,
        accept_rate=[at_least[i + 1] / at_least[i] if at_least[i] else 0.0 for i in range(depth)],
        reach=[at_least[i + 1] / n for i in range(depth)],
        verifications=n,
        histogram=[sum(a == i for a in accepted) for i in range(depth + 1)],
    )


def load_questions(bench: str) -> list[list[str]]:
    """Each question as its list of user turns (a prompts file's text parts joined, as training and the server read
    them); a record without a user turn's text raises a ValueError naming the file and line."""
    if bench == "mt-bench":
        return [row["turns"] for _, row in read_json_lines(asset_path("mt-bench"))]
    if bench == "humaneval":
        return [[row["prompt"]] for _, row in read_json_lines(asset_path("humaneval"))]
    path = Path(bench)
    if not path.is_file():
        raise FileNotFoundError(f"--bench {bench!r}: not mt-bench, humaneval or an existing JSONL file")
    questions = []
    for place, row in read_json_lines(path):
        if "prompt" in row:
            turns = [text_of(row["prompt"])]
        elif "messages" in row:
            try:
                roles = {m["role"] for m in row["messages"]}
                turns = [text_of(m["content"]) for m in row["messages"] if m["role"] == "user"]
            except (KeyError, TypeError):
                raise ValueError(f"{path}, {place}: 'messages' should be a list of {{role, content}} objects, got "
                                 f"{row['messages']!r:.80}") from None
            if "system" in roles:  # the questions are asked as user turns alone (the template's default system)
                raise ValueError(f"{path}, {place}: a system message, which eval-eagle does not send: leave it out")
        else:
            raise ValueError(f"{path}, {place}: expected a 'prompt' or 'messages' field")
        if not turns or not all(isinstance(turn, str) for turn in turns):
            raise ValueError(f"{path}, {place}: " + ("no user turn to ask" if not turns else
                             "a user turn that is not text (a string, or a list of text parts)"))
        questions.append(turns)
    return questions


@dataclass
class RunResult:
    answers: list[list[str]]  # per question, per turn
    new_tokens: list[int]  # per question
    seconds: float
    accepted: list[list[int]]  # per question: accepted draft tokens of each verification
    skipped: list[bool]  # per question: a prompt of it was refused, which ended it

    @property
    def tokens_per_s(self) -> float:
        return sum(self.new_tokens) / self.seconds


def run_questions(client: Client, questions: list[list[str]], desc: str, concurrency: int = 1) -> RunResult:
    """Answers every question turn by turn (a later turn follows the model's own earlier answers), the
    questions of a turn in groups of `concurrency` answered together."""
    n = len(questions)
    result = RunResult([[] for _ in range(n)], [0] * n, 0.0, [[] for _ in range(n)], [False] * n)
    messages: list[Conversation] = [[] for _ in range(n)]
    alive = set(range(n))  # questions not stopped by a refused prompt
    with tqdm(total=sum(map(len, questions)), desc=desc, unit="turn", file=sys.stderr) as bar:
        for turn in range(max(map(len, questions), default=0)):
            active = [i for i in range(n) if i in alive and turn < len(questions[i])]
            for start in range(0, len(active), concurrency):
                group = active[start : start + concurrency]
                for i in group:
                    messages[i].append({"role": "user", "content": questions[i][turn]})
                start_time = time.perf_counter()
                # No synchronisation needed to time it: the engine's last step returns its tokens to the host.
                replies = client.answer([messages[i] for i in group])
                result.seconds += time.perf_counter() - start_time
                for i, reply in zip(group, replies, strict=True):
                    if reply is None:
                        log.warning("%s: question %d/%d, turn %d: the prompt was refused (no room left in the "
                                    "context to answer it); skipped, with the question's later turns",
                                    desc, i + 1, n, turn + 1)
                        alive.discard(i)
                        result.skipped[i] = True
                        continue
                    result.new_tokens[i] += reply.new_tokens
                    result.accepted[i] += reply.accepted
                    result.answers[i].append(reply.text)
                    messages[i].append({"role": "assistant", "content": reply.text})
                bar.update(len(group))
    return result


def write_report(output: Path, report: dict, stats: Acceptance) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    rows = [
        "| metric | value |", "|---|---|",
        f"| τ (tokens per verification) | {_fmt(stats.tau, '.3f')} |",
        f"| verifications | {stats.verifications} |",
        f"| prompts skipped (refused) | {report['skipped']} |",
        f"| tokens/s, speculation on | {report['tokens_per_s']:.1f} |",
        f"| tokens/s, speculation off | {_fmt(report['tokens_per_s_off'], '.1f')} |",
        f"| speedup | {_fmt(report['speedup'], '.2f')} |",
        f"| answers the same as the baseline's | {_fmt(report['same_answers'], '.1%')} |",
    ]
    rows += ["", "| position | accept rate | reach |", "|---|---|---|"]
    rows += [f"| {i + 1} | {a:.3f} | {r:.3f} |" for i, (a, r) in enumerate(zip(stats.accept_rate, stats.reach,
                                                                               strict=True))]
    (output / "report.md").write_text(f"# eval-eagle: {report['bench']}\n\n" + "\n".join(rows) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    positions = range(1, len(stats.accept_rate) + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(positions, stats.accept_rate, marker="o", label="accept rate (conditional)")
    ax.plot(positions, stats.reach, marker="s", label="reach")
    ax.set(xlabel="draft position", ylabel="rate", ylim=(0, 1),
           title=f"per-position acceptance, τ = {_fmt(stats.tau, '.2f')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(output / "acceptance.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(range(1, len(stats.histogram) + 1), [h / max(stats.verifications, 1) for h in stats.histogram])
    ax.set(xlabel="tokens per verification (accepted + bonus)", ylabel="fraction of verifications",
           title="distribution of accepted length")
    fig.tight_layout()
    fig.savefig(output / "tau.png", dpi=120)
    plt.close("all")


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def evaluate(questions, client_on: Client, client_off: Client | None, depth: int, bench: str,
             settings: dict, concurrency: int = 1, measured=None, repeatable: bool = False) -> tuple[dict, Acceptance]:
    """Runs the questions with speculation on and (when given) off; `depth` is the tree's num_steps. measured(report,
    stats), when given, is called with the speculative run's report before the baseline starts (so its failure loses
    nothing), and again with the baseline's figures added. `repeatable`: the answers are the sampling's own (greedy
    or seeded), so that the two runs' may be compared (`same_answers`)."""
    spec = run_questions(client_on, questions, "speculation on", concurrency)
    stats = acceptance_stats([a for q in spec.accepted for a in q], depth)
    report = {
        "bench": bench,
        **settings,
        "questions": len(questions),
        "skipped": sum(spec.skipped),
        **asdict(stats),
        "tokens_per_s": spec.tokens_per_s,
        "tokens_per_s_off": None,
        "speedup": None,
        "same_answers": None,
        "per_question": [
            {"turns": len(a), "new_tokens": n, "verifications": len(acc), "accepted": acc, "skipped": skip}
            for a, n, acc, skip in zip(spec.answers, spec.new_tokens, spec.accepted, spec.skipped, strict=True)
        ],
    }
    if measured:
        measured(report, stats)
    if client_off:
        base = run_questions(client_off, questions, "speculation off", concurrency)
        report["tokens_per_s_off"] = base.tokens_per_s
        report["speedup"] = spec.tokens_per_s / base.tokens_per_s if base.tokens_per_s else None
        pairs = [pair for on, off in zip(spec.answers, base.answers, strict=True)  # the turns both answered
                 for pair in zip(on, off, strict=False)] if repeatable else []
        if pairs:
            report["same_answers"] = sum(on == off for on, off in pairs) / len(pairs)
        if measured:
            measured(report, stats)
    return report, stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="eval-eagle", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--target", help="HF directory, .gguf file or packaged model name (in-process)")
    parser.add_argument("--draft", help="the draft head directory (in-process)")
    parser.add_argument("--token-map", help=TOKEN_MAP_HELP)
    parser.add_argument("--endpoint", help="a running server's base URL (e.g. http://127.0.0.1:8000/v1)")
    parser.add_argument("--endpoint-off", help="the same target served with --speculative off, for the speedup")
    parser.add_argument("--model", help="the model name sent to the endpoints (default: the first each lists)")
    parser.add_argument("--bench", default="mt-bench",
                        help="mt-bench, humaneval or a prompts JSONL ({\"prompt\": text} or {\"messages\": [...]} a "
                             "line; of messages the user turns are asked, each after the model's own answer, as "
                             "MT-bench's second turns are: the file's assistant turns are left out)")
    parser.add_argument("--limit", type=int, help="only the first N questions")
    add_tree_arguments(parser, TreeShape(7, 1, 8))
    add_sampling_arguments(parser, top_k=False)  # --topk is the tree's
    parser.add_argument("--max-new-tokens", type=int, default=512, help="longest answer a turn, in tokens")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="questions answered together (1: batch-1 latency; more: faster τ, throughput tokens/s)")
    add_engine_arguments(parser)
    parser.add_argument("--mem-fraction", type=memory_fraction, default=EngineConfig.mem_fraction,
                        help="share of free GPU memory the KV caches take: the speculative engine's half of it "
                             "and the baseline as many blocks (all of it with --no-baseline); lower it to share a GPU")
    parser.add_argument("--no-baseline", action="store_true", help="skip the speculation-off run (no speedup)")
    parser.add_argument("--output", type=Path, default=Path("eval"),
                        help="directory of the reports (written over: report.json, report.md and the plots)")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    if bool(args.endpoint) == bool(args.target and args.draft):
        parser.error("give --target and --draft (in-process), or --endpoint")
    given = given_flags(parser, argv)
    if args.endpoint:
        refuse_unread(parser, given, ("target", "draft", "token_map", "topk", "num_draft_tokens", "attention",
                                      "disable_cuda_graph", "disable_overlap", "draft_fp8", "mem_fraction", "device"),
                      "--endpoint measures a running server, whose settings are its own")
    else:
        refuse_unread(parser, given, ("endpoint_off", "model"), "in-process, both engines are built here")
    if args.no_baseline:
        refuse_unread(parser, given, ("endpoint_off",), "--no-baseline runs no speculation-off baseline")
    require_positive(parser, args, "concurrency", "max_new_tokens", "limit")
    tree = None if args.endpoint else tree_shape(parser, args)  # a server's tree is its own
    params = sampling_params(parser, args)

    try:
        questions = load_questions(args.bench)[: args.limit]
    except (OSError, ValueError) as e:  # missing, a directory, unreadable, or a bad record
        parser.error(str(e))
    if args.output.exists() and not args.output.is_dir():  # found out now, not after both runs
        parser.error(f"--output {args.output}: a file; give a directory for the reports")
    if not questions:
        parser.error(f"--bench {args.bench}: no questions")
    settings = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "seed": params.seed,
                "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency}
    if args.endpoint:
        try:
            client_on = EndpointClient(args.endpoint, args.model, params, args.max_new_tokens)
            client_off = EndpointClient(args.endpoint_off, args.model, params, args.max_new_tokens) \
                if args.endpoint_off and not args.no_baseline else None
        except EndpointError as e:
            parser.error(str(e))
        settings["endpoint"] = args.endpoint
    else:
        options = engine_options(parser, args)
        target, head, tokenizer, _ = load_models_for(parser, args.target, args.draft, args.token_map, args.device)
        settings["tree"] = asdict(tree)
        # With a baseline, the speculative engine takes half the share, and the baseline as many KV blocks (built
        # second, a share of what was then free would leave it a fraction: fewer rows at once, a slower baseline).
        share = args.mem_fraction if args.no_baseline else args.mem_fraction / 2
        config = EngineConfig(tree=tree, max_batch_size=args.concurrency, mem_fraction=share, **options)
        try:
            engine_on = Engine(target, head, config)
        except ConfigError as e:  # a tree this head or context cannot hold
            parser.error(str(e))
        engine_off = None if args.no_baseline else Engine(
            target, None, replace(config, speculative=False, num_blocks=engine_on.pool.allocator.num_blocks))
        if engine_on.device.type == "cuda":  # graphs captured and kernels compiled before, not in, the timed runs
            for engine in filter(None, (engine_on, engine_off)):
                engine.warm_up(progress=True, params=params)
        client_on = EngineClient(engine_on, tokenizer, params, args.max_new_tokens)
        # The baseline answers what the speculative engine can: a tree's reserve leaves a prompt less room.
        client_off = None if engine_off is None else EngineClient(engine_off, tokenizer, params, args.max_new_tokens,
                                                                  room_of=engine_on)
    written = []  # reports written: the speculative run's, then with the baseline's figures

    def write(report: dict, stats: Acceptance) -> None:
        write_report(args.output, report, stats)
        written.append(report)

    try:
        with frozen_heap():
            report, stats = evaluate(questions, client_on, client_off, args.num_steps, args.bench, settings,
                                     args.concurrency, write, repeatable=params.greedy or params.seed is not None)
    except EndpointError as e:  # a server gone or failing mid-run
        kept = f" (the speculative run's report is in {args.output})" if written else ""
        raise SystemExit(f"eval-eagle: error: {e}{kept}") from None
    print((args.output / "report.md").read_text())
    if stats.verifications == 0:
        log.warning("no verification was reported: τ and the acceptance rates are n/a (%s)", "an endpoint without "
                    "serve-eagle's `eyas` statistics?" if args.endpoint else "every answer ended at its prefill")
    if not any(q["new_tokens"] for q in report["per_question"]):
        raise SystemExit(f"eval-eagle: error: every question's first prompt was refused (no room in the context to "
                         f"answer it): nothing was measured; report in {args.output}")


if __name__ == "__main__":
    main()
