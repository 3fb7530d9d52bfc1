"""Where does a drafter lose? Its accuracy and the verifier's certainty on the rows its run held out, by source and
by answer window.

    python -m scripts.tools.heldout_accuracy experiment=cpu_large model=eagle model.train_vocab=4096 \
        +export=outputs/eagle-large-6ep/export

Takes the training config's own overrides, so it rebuilds the run's data (from the caches) and its held-out split
(`data.val_fraction`, `data.seed`) exactly. Each held-out row is tagged with the source its prompt came from
(`data.source`, in order), then scored over the first `answer_tokens` assistant tokens of each answer (default 128,
the eval protocol's window, and null: the whole answer): the verifier's mean top-1 probability (T=1, a ceiling
indicator: eval.offline.verifier_top1) and the export's teacher-forced chain accuracy per depth
(eval.offline.score_export). The verifier runs in `+dtype` (default float32, as decoding's exactness runs do).
Writes heldout_accuracy.json next to the export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict
from rich.console import Console
from rich.table import Table

from data.datamodule import DistillDataModule
from eval.offline import first_answer_tokens, score_export, verifier_top1
from models.exports.io import load_export
from runtime.errors import UserError, exit_on_user_error


def tag_sources(datamodule: DistillDataModule, rows: list[dict[str, Any]]) -> list[str]:
    """The source of each tokenised row: the `data.source` entry whose conversation's first user turn the row's
    text contains (sources are tried in order, so a prompt two sources share goes to the first)."""
    convs, groups = datamodule.conversations(with_groups=True)
    if groups is None:
        raise UserError("data.limit mixes the sources, so held-out rows cannot be told apart by source: set "
                        "data.limit=null (as the run did, if it did).")
    sources = [datamodule.source] if isinstance(datamodule.source, str) else list(datamodule.source)
    first_turns: dict[str, str] = {}
    start = 0
    for source, count in zip(sources, groups):
        for conv in convs[start: start + count]:
            if conv.user_turns:
                first_turns.setdefault(conv.user_turns[0].strip(), Path(str(source)).stem)
        start += count
    tok = datamodule.verifier.tokenizer
    tags = []
    for row in rows:
        text = tok.decode(row["input_ids"], skip_special_tokens=False)
        tags.append(next((name for turn, name in first_turns.items() if turn and turn in text), "unknown"))
    return tags


def heldout_tables(cfg: DictConfig) -> dict[str, Any]:
    """{window: {source: {rows, assistant_tokens, verifier_top1, chain_accuracy}}} for the run `cfg` describes."""
    verifier = instantiate(cfg.verifier)
    datamodule: DistillDataModule = instantiate(cfg.data, verifier=verifier)
    _, held_out = datamodule.split(datamodule.build())
    rows = list(held_out.with_format("python"))
    tags = tag_sources(datamodule, rows)
    loaded = load_export(cfg.export, verifier)  # checked against this verifier
    windows = cfg.get("answer_tokens", [128, None])
    out: dict[str, Any] = {}
    for window in windows:
        cut = [first_answer_tokens(r, window) for r in rows]
        by_source: dict[str, list[dict[str, Any]]] = {"all": cut}
        for tag, row in zip(tags, cut):
            by_source.setdefault(tag, []).append(row)
        out[str(window)] = {}
        for name, group in by_source.items():
            tables = score_export(loaded.kind, loaded.net, verifier, group, int(cfg.get("depth", 3)),
                                  keep=loaded.train_ids)
            out[str(window)][name] = {
                "rows": len(group), "assistant_tokens": int(sum(sum(r["loss_mask"]) for r in group)),
                "verifier_top1": verifier_top1(verifier, group),
                "chain_accuracy": [float(a) for a in tables["chain_conditional"]],
            }
            print(f"[heldout] window {window}, {name}: {json.dumps(out[str(window)][name])}", flush=True)
    return out


def report(results: dict[str, Any], export: Path) -> None:
    table = Table(title=f"held-out rows of {export}: verifier certainty and drafter accuracy")
    for col in ["answer tokens", "source", "rows", "assistant tokens", "verifier top-1", "drafter d1..",
                "d1 / top-1"]:
        table.add_column(col)
    for window, groups in results.items():
        for name, r in groups.items():
            acc = r["chain_accuracy"]
            table.add_row("all" if window == "None" else window, name, str(r["rows"]), str(r["assistant_tokens"]),
                          f"{r['verifier_top1']:.3f}", " ".join(f"{a:.2f}" for a in acc),
                          f"{acc[0] / r['verifier_top1']:.2f}")
    Console(width=160).print(table)
    path = export / "heldout_accuracy.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"written: {path}")


@hydra.main(version_base="1.3", config_path="../../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    def run() -> None:
        if not cfg.get("export"):
            raise UserError("heldout_accuracy needs the export to score: add +export=outputs/<run>/export.")
        with open_dict(cfg):
            cfg.verifier.dtype = cfg.get("dtype", "float32")
            cfg.data.cache_hidden_states = False  # scored from the verifier's own forward, in cfg.dtype
        torch.set_num_threads(int(cfg.get("threads", 2)))
        report(heldout_tables(cfg), Path(cfg.export))

    exit_on_user_error(run)


if __name__ == "__main__":
    main()
