"""Roll out an export on a prompt pool with our exact decoder and record what on-policy training learns from.

    python -m eval.rollout pretrained/eagle3-smollm2 --out outputs/rollout-eagle3 --num-prompts 96
    python -m eval.rollout pretrained/eagle3-smollm2 --out outputs/rollout-eagle3 --num-prompts 96   # resumes
    python train.py experiment=opd data.rollout=outputs/rollout-eagle3

The drafter drafts a chain of `--depth` tokens each round (greedy decoding by default, `--temperature` to sample),
through `speculative_decode` itself: the output is the verifier's, token for token under greedy. A `Recorder`
wraps the drafter and keeps, per verified round, where it started, the drafter's own chain, how much of it was
accepted, and M_q's top-k at every drafted position: the verify forward computed M_q's logits at all of them,
accepted or rejected, and hands them to an observing drafter (eval.engine.protocol.Observing). Nothing is computed
twice and the decode loop is the one `python -m eval` runs. data/onpolicy.py says what a rollout directory holds.

The pool: the built-in prompts' train split by default, or any prompt source, with every prompt that matches an
evaluation prompt dropped (data.filters.EvalGuard, as training data is). `--split eval --no-decontaminate` rolls
out the evaluation prompts instead, to measure a drafter there (the recorded tau and alpha_k are this decoder's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from data.chat import prompt_ids
from data.filters import EvalGuard, apply_filters
from data.onpolicy import FORMAT, MANIFEST, VERSION, read_manifest, shard_path, write_shard
from data.prompts import Conversation, eval_prompt_texts, load_conversations, select_prompts
from eval.drafters.build import make_drafter
from eval.engine.acceptance.protocol import mean_accept_length, per_position_acceptance
from eval.engine.decode import DecodeResult, speculative_decode
from eval.engine.protocol import Draft, Drafter
from eval.engine.sampling import SamplingConfig
from eval.engine.tree import Chain
from eval.runner import user_turns
from models.eagle import Eagle1Net, Eagle3Net
from models.exports.io import Export, export_verifier, load_export, read_config
from models.families import title
from models.verifiers.core import Verifier
from models.verifiers.load import load_verifier
from runtime.errors import UserError, exit_on_user_error

# The families whose drafts on-policy training can replay: a chain unrolled step by step on the verifier's features
# (train/opd.py unrolls models.eagle.unroll over the drafter's own tokens).
ON_POLICY_NETS = (Eagle1Net, Eagle3Net)


def check_on_policy(export: Export, where: str) -> None:
    """Refuse an export whose family on-policy training cannot replay, naming those it can."""
    if not isinstance(export.net, ON_POLICY_NETS):
        can = ", ".join(title(c.kind) for c in ON_POLICY_NETS)
        raise UserError(f"{where} is {title(export.kind)} export: on-policy distillation replays a drafter's own "
                        f"chain step by step on the verifier's features, which {can} exports do; "
                        f"{title(export.kind)}'s drafts come from another forward (not yet supported). Pass an "
                        f"export of those (e.g. pretrained/eagle3-smollm2).")


class Recorder:
    """A drafter that drafts as `inner` does and records each verified round (the decode loop cannot tell them
    apart: the same proposals, the same `accepted` calls). Chains only: node i is the i-th draft."""

    def __init__(self, inner: Drafter, topk: int) -> None:
        self.inner, self.topk = inner, topk
        self.feature_layers, self.max_nodes, self.max_depth = inner.feature_layers, inner.max_nodes, inner.max_depth
        self.rounds: list[dict[str, Any]] = []
        self._start = 0
        self._seen: dict[str, Any] | None = None

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()

    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        draft = self.inner.propose(input_ids, hidden)
        if any(parent != i for i, parent in enumerate(draft.tree.parents[1:])):
            raise UserError("the rollout records chains; the drafter proposed a tree. Roll out with a chain "
                            "(--depth).")
        self._start, self._seen = input_ids.shape[1] - 1, None  # the root's index
        return draft

    def observe(self, tokens: Tensor, q_logits: Tensor) -> None:
        """The verified round (not called for the last round, cut short): M_q's top-k at the root and every draft
        but the last, the targets of drafts 1..K."""
        q = q_logits[0, :-1].float().softmax(-1)  # (K, V)
        top = q.topk(min(self.topk, q.shape[-1]), dim=-1)
        self._seen = {"start": self._start, "drafts": tokens[0, 1:].tolist(), "q_ids": top.indices.tolist(),
                      "q_probs": [[round(p, 6) for p in row] for row in top.values.tolist()]}

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        if self._seen is not None:
            self.rounds.append(self._seen | {"accepted": int(num_accepted[0])})
            self._seen = None
        self.inner.accepted(num_accepted, nodes)

    def take(self) -> list[dict[str, Any]]:
        rounds, self.rounds = self.rounds, []
        return rounds


def prompt_pool(source: str, split: str | None, num: int | None, decontaminate: bool) -> list[Conversation]:
    """The pool: `num` conversations of `source` round-robin over categories, those matching an evaluation prompt
    dropped first when `decontaminate`."""
    convs = load_conversations(source, split=split)
    if decontaminate:
        guard = EvalGuard(eval_prompt_texts())
        keep = apply_filters([c.user_turns[0] if c.user_turns else "" for c in convs], None, guard, None,
                             f"{source} against the eval prompts")
        convs = [convs[i] for i in keep]
    if not convs:
        raise UserError(f"--prompts {source}: no prompt left after decontamination.")
    return select_prompts(convs, num)


def settings_of(args: argparse.Namespace, export: Export, verifier: Verifier) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "export": str(args.export), "kind": export.kind,
            "verifier_fingerprint": verifier.fingerprint,
            "settings": {"prompts": args.prompts, "split": args.split, "num_prompts": args.num_prompts,
                         "decontaminate": args.decontaminate, "max_new_tokens": args.max_new_tokens,
                         "depth": args.depth, "topk": args.topk, "temperature": args.temperature,
                         "seed": args.seed, "shard_size": args.shard_size, "dtype": args.dtype}}


def start_or_resume(out: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest, or check that a rollout already there was made with the same settings (it resumes)."""
    if (out / MANIFEST).is_file():
        old = read_manifest(out)
        for key in ("export", "kind", "verifier_fingerprint", "settings"):
            if old.get(key) != manifest[key]:
                raise UserError(f"{out} holds a rollout made with other {key} ({old.get(key)!r}, now "
                                f"{manifest[key]!r}): rerun with its settings to resume it, or pass another --out.")
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))


def record_prompt(verifier: Verifier, recorder: Recorder, conv: Conversation, max_new_tokens: int, eos: list[int],
                  sampling: SamplingConfig | None, generator: torch.Generator | None) -> tuple[dict, DecodeResult]:
    ids = prompt_ids(verifier.tokenizer, user_turns(conv)[0], verifier.rendering)  # the first turn, as eval's
    x = torch.tensor([ids], device=verifier.device)
    recorder.take()
    result = speculative_decode(verifier, recorder, x, max_new_tokens, eos, sampling, generator)
    line = {"id": conv.id, "category": conv.category, "input_ids": ids + result.tokens[0].tolist(),
            "prompt_length": len(ids), "accept_lengths": result.accept_lengths[:, 0].tolist(),
            "rounds": recorder.take()}
    return line, result


def summary(lines: list[dict[str, Any]], depth: int) -> dict[str, Any]:
    """tau and alpha_k over every recorded prompt's rounds, as eval.engine.acceptance defines them."""
    lengths = torch.tensor([a for line in lines for a in line["accept_lengths"]], dtype=torch.long)[:, None]
    return {"prompts": len(lines), "rounds": int(lengths.shape[0]), "tau": round(mean_accept_length(lengths), 4),
            "alpha": [round(float(a), 4) for a in per_position_acceptance(lengths, depth)]}


def rollout(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out).expanduser()
    config = read_config(Path(args.export).expanduser())
    source = export_verifier(config, Path(args.export) / "config.json")
    if source is None:
        raise UserError(f"{args.export}: the export names no verifier; re-export it with a current train.py.")
    verifier = load_verifier(source, args.dtype, "cpu" if args.device == "cpu" else "auto", args.cache_dir)
    export = load_export(Path(args.export).expanduser(), verifier)
    check_on_policy(export, f"--export {args.export}")
    start_or_resume(out, settings_of(args, export, verifier))
    sampling = SamplingConfig(temperature=args.temperature) if args.temperature > 0 else None
    pool = prompt_pool(args.prompts, args.split, args.num_prompts, args.decontaminate)
    gen_eos = verifier.model.generation_config.eos_token_id
    eos = sorted({verifier.tokenizer.eos_token_id} | set(gen_eos if isinstance(gen_eos, list) else [gen_eos]) - {None})
    shards = [pool[i: i + args.shard_size] for i in range(0, len(pool), args.shard_size)]
    todo = [i for i in range(len(shards)) if not shard_path(out, i).is_file()]
    if len(todo) < len(shards):
        print(f"[rollout] {len(shards) - len(todo)} of {len(shards)} shards done already: resuming")
    for i in tqdm(todo, desc="rollout shards"):
        # Each shard draws from its own seed: a resumed rollout samples what an unbroken one would have.
        generator = torch.Generator(verifier.device).manual_seed(args.seed * 100_003 + i)
        drafter = make_drafter(None, verifier, Chain(args.depth), checkpoint=export, sampling=sampling,
                               generator=torch.Generator(verifier.device).manual_seed(args.seed + i))
        recorder = Recorder(drafter, args.topk)
        lines = [record_prompt(verifier, recorder, conv, args.max_new_tokens, eos, sampling, generator)[0]
                 for conv in shards[i]]
        write_shard(out, i, lines)
    lines = [json.loads(x) for i in range(len(shards)) for x in shard_path(out, i).read_text().splitlines()]
    result = summary(lines, args.depth)
    manifest = read_manifest(out) | {"summary": result}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    print(f"[rollout] {out}: {result['prompts']} prompts, {result['rounds']} rounds, tau {result['tau']:.3f}, "
          f"alpha {result['alpha']}")
    return result


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval.rollout", description=__doc__.splitlines()[0])
    ap.add_argument("export", help="the export that drafts (EAGLE-1 or EAGLE-3)")
    ap.add_argument("--out", required=True, help="the rollout directory (an unfinished one resumes)")
    ap.add_argument("--prompts", default="builtin", help="prompt source: builtin or a prompt file")
    ap.add_argument("--split", default="train", help="the built-in set's split (train, or eval to measure)")
    ap.add_argument("--num-prompts", type=int, default=None, help="round-robin over categories; default all")
    ap.add_argument("--no-decontaminate", dest="decontaminate", action="store_false",
                    help="keep prompts that match an evaluation prompt (to measure on the eval split)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=3, help="drafts per round (a chain)")
    ap.add_argument("--topk", type=int, default=20, help="M_q's top-k recorded at each drafted position")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled decoding")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-size", type=int, default=8, help="prompts per shard (the unit a resume keeps)")
    ap.add_argument("--dtype", default="bfloat16", help="the verifier's dtype (training's default: bfloat16)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-dir", default=None)
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    for name in ("num_prompts", "depth", "topk", "shard_size", "max_new_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')}={value}: give a whole number of at least 1.")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cache_dir is None:
        import os

        args.cache_dir = str(Path(os.environ.get("SPECDRAFT_CACHE", "~/.cache/specdraft")).expanduser())
    return rollout(args)


if __name__ == "__main__":
    exit_on_user_error(main)
