"""The conformance matrix as markdown, from a junit XML of tests/test_conformance_matrix.py (every cell from a test):

    python -m pytest tests/test_conformance_matrix.py --junitxml=/tmp/conformance.xml
    python -m scripts.tools.conformance_table /tmp/conformance.xml [more.xml ...] >> docs/results/conformance.md

Rows: the verifier architectures; columns: the drafter families; each cell three marks, train / exact decode / vLLM
serve (vLLM: every family it serves, each from its own launch; older runs launched one family per architecture, named
by --vllm-family). pass ✓, fail ✗, skipped s, not run -; R: vLLM refuses that family for the architecture with the
message the test asserts.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET

MARK = {"passed": "✓", "failed": "✗", "skipped": "s"}
CELL = re.compile(r"^test_(train|exact_decode|vllm_serve|vllm_refuses)\[([^\]-]+)(?:-([^\]]+))?\]$")


def outcomes(path: str) -> tuple[dict[tuple[str, str, str], str], float]:
    """(test, arch, family) -> passed / failed / skipped, and the run's total seconds."""
    root = ET.parse(path).getroot()
    out, total = {}, 0.0
    for case in root.iter("testcase"):
        m = CELL.match(case.get("name", ""))
        if not m:
            continue
        total += float(case.get("time", 0.0))
        test, arch, family = m.group(1), m.group(2), m.group(3) or ""
        state = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            state = "failed"
        elif case.find("skipped") is not None:
            state = "skipped"
        out[test, arch, family] = state
    return out, total


def table(cells: dict[tuple[str, str, str], str], vllm_family: str = "eagle3") -> str:
    archs = list(dict.fromkeys(a for _, a, _ in cells))
    families = list(dict.fromkeys(f for t, _, f in cells if t == "train"))
    lines = ["| verifier | " + " | ".join(families) + " |", "|---|" + "---|" * len(families)]
    for arch in archs:
        row = []
        for fam in families:
            marks = [MARK.get(cells.get(("train", arch, fam), ""), "-"),
                     MARK.get(cells.get(("exact_decode", arch, fam), ""), "-")]
            # vllm_serve and vllm_refuses name their family (older runs: none, meaning the one vLLM family)
            old = fam == vllm_family
            refused = cells.get(("vllm_refuses", arch, fam)) or (cells.get(("vllm_refuses", arch, "")) if old else None)
            served = cells.get(("vllm_serve", arch, fam)) or (cells.get(("vllm_serve", arch, "")) if old else None)
            if refused or served:
                marks.append("R" if refused == "passed" else MARK.get(refused or served or "", "-"))
            row.append(" ".join(marks))
        lines.append(f"| {arch} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", nargs="+", help="junit XMLs written by pytest --junitxml (a later one's cells win)")
    parser.add_argument("--vllm-family", default="eagle3", help="the family the vLLM cells serve")
    args = parser.parse_args(argv)
    cells, total = {}, 0.0
    for path in args.junit:
        more, seconds = outcomes(path)
        cells, total = cells | more, total + seconds
    for _, arch, fam in [k for k in cells if k[0] == "vllm_refuses"]:  # the refusal test replaced the serve test
        if fam in ("", args.vllm_family):
            cells.pop(("vllm_serve", arch, ""), None)
    if not cells:
        print(f"{args.junit} hold no test_conformance_matrix cells", file=sys.stderr)
        return 1
    print(table(cells, args.vllm_family))
    counts = {s: sum(v == s for v in cells.values()) for s in ("passed", "failed", "skipped")}
    print(f"\nCells: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped; "
          f"{total:.0f} s of test time.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
