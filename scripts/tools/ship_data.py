"""Build a verifier's self-distilled training set and pack it as a shipped set (data/shipped.py): the data steps of
`train.py` (prompts -> decontamination -> the verifier's answers, resumable by shard), then exact de-duplication of
prompts across sources, then Parquet parts and a manifest under shipped/data/<name>/.

    python -m scripts.tools.registry_prompts --out ~/.cache/specdraft/prompts/registry20.jsonl --per-set 20 \\
        --chitchat 2500 --eval-prompts ~/.cache/specdraft/evalsets/mt_bench_question.jsonl
    python -m scripts.tools.ship_data experiment=ship_data                 # kill and rerun: resumes from its shards
    python -m scripts.tools.ship_data experiment=ship_data ship.out=/tmp/my-set   # somewhere else

The recipe (sources, answer length, decontamination files) is conf/experiment/ship_data.yaml; the set it made is
described in docs/results/shipped-data.md.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import datasets
import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from data.benchmarks import BENCHMARKS, NONE, declared_lists, load_lists, manifest_section
from data.chat import prompt_ids
from data.filters import EvalGuard
from data.long_tasks import copy_share
from data.multiturn import second_turn_rows
from data.prompts import eval_prompt_texts
from data.selfdistill import first_turn
from data.shipped import ROOT, check_replaceable, pack
from runtime.errors import UserError, exit_on_user_error
from train.record import cpu_kind


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _label(source: str) -> str:
    return source if source in ("builtin", "selfgen") else Path(source).stem


def answer_stats(ds: datasets.Dataset, eos: int, n: int = 8) -> dict[str, float | int]:
    """What a small verifier's greedy answers are like: how many never end (cut at max_new_tokens), the share of
    assistant tokens that complete an n-gram already seen in the same answer (greedy loops, lists, code), and the
    mean share of an answer's token 4-grams found in its prompt (how much answers copy from their input)."""
    cut = repeated = total = 0
    copied: list[float] = []
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        answer = [t for t, m in zip(ids, mask) if m]
        copied.append(copy_share([t for t, m in zip(ids, mask) if not m], answer, 4))
        cut += eos not in answer
        seen: set[tuple[int, ...]] = set()
        for i in range(n - 1, len(answer)):
            gram = tuple(answer[i - n + 1: i + 1])
            repeated += gram in seen
            seen.add(gram)
        total += len(answer)
    return {"rows_without_eos": cut, f"assistant_tokens_completing_a_repeated_{n}gram": repeated,
            f"share_completing_a_repeated_{n}gram": round(repeated / max(total, 1), 4),
            "answer_4grams_found_in_the_prompt": round(sum(copied) / max(len(copied), 1), 4)}


def decontamination(cfg: DictConfig, declared: dict[str, list[str] | str],
                    files: Any) -> dict[str, Any]:
    """Point the data module at the union of the lists the sources declared (one prompt file of their texts under
    cache_dir/evalsets/), or turn decontamination off where every source said `none`; returns the manifest's
    `decontaminated_against`."""
    names = [n for n in BENCHMARKS if any(isinstance(v, list) and n in v for v in declared.values())]
    texts, report = load_lists(names, {str(k): (None if v is None else str(v)) for k, v in dict(files).items()})
    builds = {}
    for source in [cfg.data.source] if isinstance(cfg.data.source, str) else list(cfg.data.source):
        built = Path(f"{Path(str(source)).expanduser()}.decontam.json")  # written by a prompt builder beside its file
        if built.is_file():
            builds[_label(str(source))] = json.loads(built.read_text())
    if all(v == NONE for v in declared.values()):
        cfg.data.decontaminate = False
        applied: list[str] = []
    else:
        body = "".join(json.dumps({"prompt": t}) + "\n" for t in texts)
        path = Path(cfg.cache_dir).expanduser() / "evalsets" / \
            f"decontam-{hashlib.sha256(body.encode()).hexdigest()[:16]}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        if body and not path.is_file():
            path.write_text(body)
        cfg.data.decontaminate = True
        cfg.data.eval_prompts = [str(path)] if body else []
        applied = sorted(set(names) | {"builtin_eval", "humaneval"}, key=BENCHMARKS.index)
    return manifest_section(declared, report, applied, builds)


@hydra.main(version_base="1.3", config_path="../../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    exit_on_user_error(lambda: ship(cfg))


def ship(cfg: DictConfig) -> None:
    if cfg.data.get("limit") is not None:
        raise UserError(f"scripts/ship_data packs whole sources, each row labelled with its source; data.limit="
                        f"{cfg.data.limit} mixes them. Give a shorter prompt file instead (scripts/tools/long_tasks.py "
                        f"--num, registry_prompts.py --per-set).")
    if cfg.data.mode != "selfdistill":
        raise UserError(f"scripts/ship_data builds a self-distilled set; data.mode={cfg.data.mode!r}. Use "
                        f"experiment=ship_data (or data=selfdistill).")
    ship_cfg = cfg.get("ship") or {}
    name = ship_cfg.get("name") or f"{cfg.verifier.get('name', 'verifier')}-selfdistill-v1"
    out = Path(ship_cfg.get("out") or ROOT / name).expanduser()
    check_replaceable(out, bool(ship_cfg.get("force", False)))  # before hours of generation
    sources = [cfg.data.source] if isinstance(cfg.data.source, str) else list(cfg.data.source)
    declared = declared_lists([_label(str(s)) for s in sources], ship_cfg.get("decontaminate"))
    decontam = decontamination(cfg, declared, ship_cfg.get("benchmarks") or {})
    verifier = instantiate(cfg.verifier)
    datamodule = instantiate(cfg.data, verifier=verifier)
    start = time.perf_counter()
    convs, groups = datamodule.conversations(with_groups=True)
    ds = datamodule.build()  # resumable: finished shards are kept
    seconds = time.perf_counter() - start
    # Each kept row's source: build_selfdistill keeps the conversations in order and leaves out the prompts of
    # max_length tokens or more.
    tok = verifier.tokenizer
    labels = [_label(s) for s, n in zip(sources, groups) for _ in range(n)]
    kept = [i for i, c in enumerate(convs)
            if len(prompt_ids(tok, first_turn(c), verifier.rendering)) < cfg.data.max_length]
    if len(kept) != len(ds) or any(ds[j]["id"] != convs[i].id for j, i in enumerate(kept[:50])):
        raise RuntimeError(f"{len(ds)} rows against {len(kept)} kept conversations: the build and its sources differ")
    ds = ds.add_column("source", [labels[i] for i in kept])
    # Exact de-duplication of prompts across sources (each source is already de-duplicated within itself).
    seen: set[str] = set()
    unique = []
    for j, (ids, mask) in enumerate(zip(ds["input_ids"], ds["loss_mask"])):
        prompt = ids[: mask.index(1)] if 1 in mask else ids
        digest = hashlib.sha1(bytes(str(prompt), "ascii")).hexdigest()
        if digest not in seen and 1 in mask:
            seen.add(digest)
            unique.append(j)
    print(f"[ship] {len(ds) - len(unique)} rows left out (a prompt seen in an earlier row, or no answer token)")
    ds = ds.select(unique)
    extra = [str(Path(f).expanduser()) for f in cfg.data.eval_prompts]
    second = int(ship_cfg.get("second_turns") or 0)
    if second:  # multi-turn: the verifier writes a follow-up turn after its own answer, then answers it
        turns = second_turn_rows(verifier, ds, second, cfg.cache_dir, seed=cfg.seed, max_length=cfg.data.max_length,
                                 max_new_tokens=cfg.data.max_new_tokens, batch_size=cfg.data.gen_batch_size,
                                 guard=EvalGuard(eval_prompt_texts(extra)),
                                 messages={c.id: first_turn(c) for c in convs})
        ds = datasets.concatenate_datasets([ds, turns])  # appended: the single-turn rows' parts stay as they were
    info = {
        "generation": {k: OmegaConf.to_container(cfg.data, resolve=True)[k] for k in
                       ("generator", "max_new_tokens", "temperature", "max_length", "gen_batch_size", "seed")}
                      | {"dtype": str(verifier.model.dtype).removeprefix("torch."),
                         "turns": "the first user turn of every prompt; a second turn (the verifier's own follow-up, "
                                  "T=1, top-p 0.95, and its greedy answer) on "
                                  f"{sum(i.endswith('+turn2') for i in ds['id'])} rows"},
        "sources": [{"source": str(s), "label": _label(str(s)), "conversations_in": n}
                    for s, n in zip(sources, groups)]
                   + ([{"selfgen": OmegaConf.to_container(cfg.data.selfgen, resolve=True)}]
                      if "selfgen" in sources else []),
        "decontaminated_against": decontam,
        "answers": answer_stats(ds, tok.eos_token_id),
        "built_with": {"command": "python -m scripts.tools.ship_data " + " ".join(sys.argv[1:]), "commit": _commit(),
                       "machine": cpu_kind(), "seconds_this_run": round(seconds)},
    }
    manifest = pack(ds, out, verifier, info, force=bool(ship_cfg.get("force", False)))
    size = sum(e["bytes"] for e in manifest["files"])
    print(f"[ship] {manifest['counts']['conversations']} conversations, {manifest['counts']['assistant_tokens']} "
          f"assistant tokens ({manifest['counts']['tokens']} in all) -> {out} ({size / 2**20:.1f} MiB in "
          f"{len(manifest['files'])} parts)")
    for label, c in manifest["by_source"].items():
        print(f"[ship]   {label}: {c['conversations']} conversations, {c['assistant_tokens']} assistant tokens")


if __name__ == "__main__":
    main()
