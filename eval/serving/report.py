"""The load sweep's result (sweep.py) as a person reads it: the table in the terminal (one per length group,
then the whole set) and load_speedup.png (speedup against concurrency, a panel per length group)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _table(rows: list[dict[str, Any]], title: str, pred: dict[str, Any]) -> Any:
    from rich.table import Table

    ks = sorted({s["k"] for r in rows for s in r["spec"]})
    table = Table(title=title)
    for col in ("concurrency", "plain", *(f"K={k}" for k in ks), "best K", "schedule", "predicted K"):
        table.add_column(col, justify="right")
    for r in rows:
        cells = {s["k"]: "failed" if "error" in s else
                 f"{s['tokens_per_s']:.1f} ({s['speedup']:.2f}x; {s['acceptance_length'] or 0:.2f})"
                 for s in r["spec"]}
        sched = r.get("scheduled_speedup")
        plain = "failed" if "error" in r else f"{r['plain_tokens_per_s']:.1f}"
        table.add_row(str(r["concurrency"]), plain, *(cells.get(k, "failed") for k in ks),
                      "unknown" if r["best_k"] is None else str(r["best_k"]),
                      "-" if sched is None else f"{r['scheduled_tokens_per_s']:.1f} ({sched:.2f}x)",
                      str(pred.get(str(r["concurrency"]), "-")))
    return table


def _schedule_line(record: dict[str, Any]) -> str:
    """The schedule as the terminal shows it: its ranges, or the note saying why there is none or why it is plain."""
    ranges = record["schedule"]["ranges"] if record.get("schedule") else "none"
    note = f" ({record['schedule_note']})" if record.get("schedule_note") else ""
    return f"schedule {ranges}{note}; crossover measured {record['measured_crossover']}"


def print_table(result: dict[str, Any]) -> None:
    """The sweep in the terminal: per concurrency, plain tok/s and each K's tok/s, speedup and acceptance; one
    table per length group, then the whole set."""
    from rich.console import Console

    console = Console()
    pred = (result.get("prediction") or {}).get("best_k", {})
    head = f"vLLM {result['version']} under load: output tokens/s (speedup over plain; acceptance length)"
    for name, g in (result.get("by_length") or {}).items():
        t = g["prompt_tokens"]
        console.print(_table(g["by_concurrency"], f"{head}, {name}: {g['prompts']} prompts of {t['min']}-{t['max']} "
                                                  f"tokens (median {t['median']:g})", {}))
        console.print(f"{name}: {_schedule_line(g)}")
    whole = " , every group pooled" if result.get("by_length") else ""
    console.print(_table(result["by_concurrency"], head + whole, pred))
    console.print(f"vLLM num_speculative_tokens_per_batch_size: {_schedule_line(result)}, predicted "
                  f"{(result.get('prediction') or {}).get('crossover', '-')}")
    for e in result["errors"]:
        console.print(f"vLLM failed {e['setting']}: {e['error']} (its log: {result['setup']['logs']})")


def plot(result: dict[str, Any], path: Path) -> Path:
    """Speedup over plain against concurrency: one line per K, one for the schedule; a panel per length group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"{n} prompts (median {g['prompt_tokens']['median']:g} tokens)", g["by_concurrency"])
              for n, g in (result.get("by_length") or {}).items()] or [("", result["by_concurrency"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False, sharey=True)
    for ax, (name, rows) in zip(axes[0], panels):
        levels = [r["concurrency"] for r in rows]
        for k in sorted({s["k"] for r in rows for s in r["spec"]}):
            pts = [(r["concurrency"], s["speedup"]) for r in rows for s in r["spec"]
                   if s["k"] == k and "error" not in s]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"K={k}")
        sched = [(r["concurrency"], r["scheduled_speedup"]) for r in rows if r.get("scheduled_speedup")]
        if sched:
            ax.plot(*zip(*sched), marker="s", color="black", linewidth=2, label="schedule")
        ax.axhline(1.0, color="gray", linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set(xlabel="concurrency (clients)", title=f"vLLM {result['version']}: speedup under load"
               + (f"\n{name}" if name else ""))
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("output tokens/s over plain vLLM")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
