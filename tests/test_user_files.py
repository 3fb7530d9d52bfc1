"""The data tools never replace what a path the user named holds: a prompt file (scripts/tools/long_tasks.py,
registry_prompts.py) or a folder a shipped set is packed into (scripts/tools/ship_data.py, data.shipped.pack) is
refused with one message, before the tool's work, unless the user says to replace it."""

from __future__ import annotations

import json
import subprocess
import sys

import datasets
import pytest

from data.shipped import MANIFEST, check_replaceable, pack
from helpers import ROOT, compose_train
from runtime.errors import UserError
from runtime.io import write_new_files

NOTES = "my own notes\n"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("tool", ["scripts.tools.long_tasks", "scripts.tools.registry_prompts"])
def test_a_prompt_tool_refuses_an_existing_out_file_before_its_work(tool, tmp_path):
    out = tmp_path / "mine.jsonl"
    out.write_text(NOTES)
    done = _cli(tool, "--out", str(out))
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{out} exists" in done.stderr and "--force" in done.stderr and "Traceback" not in done.stderr
    assert out.read_text() == NOTES


def test_files_are_written_whole_and_replaced_only_when_asked(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "sub" / "b.json"
    b.parent.mkdir()
    b.write_text(NOTES)
    with pytest.raises(UserError, match="b.json exists.*--force"):
        write_new_files({a: "1\n", b: "2\n"})
    assert not a.exists() and b.read_text() == NOTES  # refused before either is written
    write_new_files({a: "1\n", b: "2\n"}, replace=True)
    assert a.read_text() == "1\n" and b.read_text() == "2\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.jsonl", "b.json", "sub"]  # no scratch file left


def _tiny_set(tiny) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"id": ["r0"], "category": ["c"], "source": ["s"], "input_ids": [[1, 2, 3]],
                                       "loss_mask": [[0, 1, 1]]})


def test_packing_a_set_keeps_a_folder_that_holds_something_else(tiny, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text(NOTES)
    with pytest.raises(UserError, match=r"holds no shipped set but \['notes.txt'\].*ship.force=true"):
        pack(_tiny_set(tiny), mine, tiny, {})
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    target = tmp_path / "set"
    pack(_tiny_set(tiny), target, tiny, {})
    pack(_tiny_set(tiny), target, tiny, {})  # a set is replaced by a set: reruns work
    (target / "notes.txt").write_text(NOTES)
    with pytest.raises(UserError, match=r"holds a shipped set and also \['notes.txt'\]"):
        check_replaceable(target)
    a_file = tmp_path / "file"
    a_file.write_text(NOTES)
    with pytest.raises(UserError, match="is not a folder"):
        check_replaceable(a_file)
    pack(_tiny_set(tiny), mine, tiny, {}, force=True)  # said explicitly: replaced
    assert json.loads((mine / MANIFEST).read_text())["counts"]["conversations"] == 1


def test_ship_data_refuses_the_folder_before_generating(tmp_path):
    from scripts.tools.ship_data import ship

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text(NOTES)
    cfg = compose_train(["experiment=ship_data", "verifier=tiny", "data.source=[builtin]",
                         "ship.decontaminate.builtin=none", f"cache_dir={tmp_path / 'c'}", f"ship.out={mine}"],
                        tmp_path)
    with pytest.raises(UserError, match="holds no shipped set"):
        ship(cfg)
    assert not (tmp_path / "c").exists()  # nothing generated, no verifier built
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
