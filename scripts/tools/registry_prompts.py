"""Prompt files shipped inside registry packages, written as one prompt JSONL that `data.source=` reads.

    python -m scripts.tools.registry_prompts --out prompts/registry.jsonl    # evals + chitchat, 200 per eval set
    python -m scripts.tools.registry_prompts --out p.jsonl --per-set 50 --include-noncommercial

Each package is fetched with `pip download --no-deps` into a temporary directory, its sha256 is checked against the
value pinned below, and its files are read with `zipfile`: nothing is installed or imported.

- evals==3.0.1.post1 (OpenAI evals, MIT): `evals/registry/data/**.jsonl` rows whose `input` is a chat (list of
  {role, content}) or a string. Licences: the package's LICENSE.md says the MIT licence covers everything except the
  datasets it lists under "Dataset Licenses", each with its `Location` folder and per-component licences. A folder
  with any NonCommercial (CC BY-NC) component is left out unless --include-noncommercial; the others are kept and
  their listed licences are printed. At most --per-set rows per eval set (file).
- chitchat-dataset==0.9.0 (MIT): 7,168 casual conversations; the first speaker's opening messages are the prompt.
Every prompt is deduplicated (exact, after normalisation) and checked against the evaluation prompts (built-in eval
split, HumanEval, --eval-prompts files): exact or near-duplicate matches are dropped. Per-source counts and licences
are printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter, defaultdict
from pathlib import Path

from data.filters import EvalGuard, normalise
from data.prompts import eval_prompt_texts
from runtime.errors import exit_on_user_error
from runtime.io import refuse_existing, write_new_files

PINNED = {  # computed once on 2026-11-29 from PyPI's files
    "evals==3.0.1.post1": ("evals-3.0.1.post1-py3-none-any.whl",
                           "0abcb2051303500784b1641a6e4f6b813ed43ad64f879a37d344a6774eb8eb78"),
    "chitchat-dataset==0.9.0": ("chitchat_dataset-0.9.0-py3-none-any.whl",
                                "7bf89f36645e2d5ec87d53370c8e851b5a688479c7beb7079cb4c87fc5acea3e"),
}
DATA = "evals/registry/data/"


def fetch(spec: str, into: Path) -> Path:
    """pip download --no-deps `spec` into `into`; the wheel's sha256 must be the pinned one."""
    name, digest = PINNED[spec]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d",
                    str(into), spec], check=True)
    path = into / name
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != digest:
        sys.exit(f"{spec}: sha256 {actual} differs from the pinned {digest}; refusing to read it.")
    return path


def noncommercial_and_licences(license_md: str) -> tuple[set[str], dict[str, list[str]]]:
    """From evals' LICENSE.md: the data folders with a NonCommercial component, and every listed folder's licences."""
    licences: dict[str, list[str]] = {}
    for block in re.split(r"\n#### ", license_md)[1:]:
        loc = re.search(r"\*\*Location\*\*:\s*(\S+)", block)
        if loc:
            folder = loc.group(1).rstrip("/").removeprefix(DATA)
            licences[folder] = [m.strip() for m in re.findall(r"\*\*License\*\*:\s*([^\n]+)", block)]
    nc = {f for f, ls in licences.items() if any(re.search(r"NonCommercial|BY-NC", x, re.I) for x in ls)}
    return nc, licences


def chat_prompt(value) -> tuple[list[dict[str, str]] | None, str | None]:
    """(messages up to the first user turn, prompt text) of an evals `input`, or (None, None)."""
    if isinstance(value, str) and value.strip():
        return [{"role": "user", "content": value}], value
    if isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value):
        msgs = []
        for m in value:
            role = m.get("role")
            if role not in ("system", "user"):
                break
            msgs.append({"role": role, "content": m["content"]})
            if role == "user":
                return msgs, m["content"]
    return None, None


def evals_prompts(wheel: Path, per_set: int, include_nc: bool) -> tuple[list[dict], dict]:
    z = zipfile.ZipFile(wheel)
    nc, licences = noncommercial_and_licences(z.read("evals-3.0.1.post1.dist-info/LICENSE.md").decode())
    out, skipped_nc, lfs = [], Counter(), 0
    for name in sorted(n for n in z.namelist() if n.startswith(DATA) and n.endswith(".jsonl")):
        folder = name[len(DATA):].split("/")[0]
        raw = z.read(name)
        if raw.startswith(b"version https://git-lfs"):
            lfs += 1
            continue
        if folder in nc and not include_nc:
            skipped_nc[folder] += 1
            continue
        taken = 0
        for line in raw.decode("utf-8", "replace").splitlines():
            if taken >= per_set:
                break
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            msgs, text = chat_prompt(rec.get("input")) if isinstance(rec, dict) else (None, None)
            if msgs:
                out.append({"messages": msgs, "prompt": text, "category": f"evals/{folder}", "source": "evals",
                            "licence": "; ".join(licences.get(folder, ["MIT (evals repository)"]))})
                taken += 1
    return out, {"noncommercial_folders": sorted(nc), "skipped_nc_files": dict(skipped_nc), "lfs_pointers": lfs,
                 "licences": licences}


def chitchat_prompts(wheel: Path) -> list[dict]:
    data = json.loads(zipfile.ZipFile(wheel).read("chitchat_dataset/dataset.json"))
    out = []
    for cid, conv in data.items():
        groups = conv.get("messages") or []
        if groups and groups[0]:
            text = " ".join(m["text"] for m in groups[0] if m.get("text"))
            out.append({"prompt": text, "category": "chitchat", "source": "chitchat", "licence": "MIT", "id": cid})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--per-set", type=int, default=200, help="at most this many prompts per eval set file")
    ap.add_argument("--include-noncommercial", action="store_true")
    ap.add_argument("--eval-prompts", nargs="*", default=[], help="extra eval files to decontaminate against")
    ap.add_argument("--chitchat", type=int, default=None, help="at most this many chitchat prompts")
    ap.add_argument("--sources", nargs="*", default=["evals", "chitchat"], choices=["evals", "chitchat"])
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = ap.parse_args()
    exit_on_user_error(lambda: refuse_existing([args.out], args.force))  # before the downloads

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        if "evals" in args.sources:
            recs, info = evals_prompts(fetch("evals==3.0.1.post1", Path(tmp)), args.per_set, args.include_noncommercial)
            print(f"[evals] {len(recs)} prompts from {len({r['category'] for r in recs})} eval sets "
                  f"(<= {args.per_set} each); {info['lfs_pointers']} files were git-lfs pointers (no data)")
            print(f"[evals] non-commercial folders per LICENSE.md: {info['noncommercial_folders']} -> "
                  f"{'INCLUDED' if args.include_noncommercial else 'left out'} "
                  f"({sum(info['skipped_nc_files'].values())} files)")
            for folder, ls in info["licences"].items():
                print(f"[evals]   {folder}: {'; '.join(ls)}")
            rows += recs
        if "chitchat" in args.sources:
            recs = chitchat_prompts(fetch("chitchat-dataset==0.9.0", Path(tmp)))[: args.chitchat]
            print(f"[chitchat] {len(recs)} prompts (MIT)")
            rows += recs
    guard = EvalGuard(eval_prompt_texts(args.eval_prompts))
    seen, kept, dropped = set(), [], Counter()
    for r in rows:
        key = normalise(r["prompt"])
        if not key:
            dropped[(r["source"], "empty")] += 1
        elif key in seen:
            dropped[(r["source"], "duplicate")] += 1
        elif guard.contaminated(r["prompt"]):
            dropped[(r["source"], "matches an eval prompt")] += 1
        else:
            seen.add(key)
            kept.append(r)
    lines = (json.dumps({"id": r.get("id", f"{r['source']}-{i}"), **{k: v for k, v in r.items() if k != "id"}},
                        ensure_ascii=False) + "\n" for i, r in enumerate(kept))
    exit_on_user_error(lambda: write_new_files({args.out: "".join(lines)}, args.force))
    per = defaultdict(int)
    for r in kept:
        per[r["source"]] += 1
    print(f"\n{'source':<10}{'kept':>8}  dropped")
    for src in sorted({r['source'] for r in rows}):
        d = {why: n for (s, why), n in dropped.items() if s == src}
        print(f"{src:<10}{per[src]:>8}  {d or '-'}")
    print(f"wrote {len(kept)} prompts to {args.out}")


if __name__ == "__main__":
    main()
