"""Long-input training tasks (data/long_tasks.py), their decontamination lists (data/benchmarks.py), and the shipped
set's manifest as scripts/tools/ship_data.py writes it for them (the tiny verifier answers)."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from data.benchmarks import declared_lists, guard_for, load_lists
from data.chat import prompt_ids
from data.filters import EvalGuard
from data.long_tasks import TASKS, Document, build_tasks, chunks, copy_share, default_documents, eval_document_names
from runtime.errors import UserError

# A GSM8K-like question, a CNN/DailyMail-like article and a WMT-like pair: the list fixture.
ARTICLE = ("The city council voted on Tuesday to close the old harbour bridge for repairs after engineers found "
           "cracks in two of its steel supports. Traffic will be diverted through the northern tunnel for at least "
           "six months, and ferries will run every twenty minutes during the morning rush. The mayor said the "
           "repairs would cost about twelve million and be paid from the transport budget, while shop owners near "
           "the bridge asked for help with the expected loss of customers. ") * 4
LIST_RECORDS = [{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
                             "in May. How many clips did Natalia sell altogether in April and May?"},
                {"article": ARTICLE, "highlights": "Bridge closed for repairs."},
                {"translation": {"de": "Das Haus ist klein.", "en": "The house is small."}}]


def _doc(text: str, title: str = "t", kind: str = "prose") -> Document:
    return Document(title, text, kind, f"test {title}", "MIT")


def _prose(seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["alpha", "river", "engine", "table", "signal", "garden", "`config_value`", "window", "market", "stone",
             "cloud", "paper", "`load_data`", "the", "of", "and", "a", "is"]
    paras = [" ".join(rng.choice(vocab) for _ in range(60)) + "." for _ in range(12)]
    return "\n\n".join(paras)


def test_tasks_are_long_cover_every_kind_and_leave_out_the_eval_documents(smollm2):
    """From the real sources: every task kind, each prompt 300+ tokens after the chat template carrying a passage
    of 1,200+ characters verbatim, none made from a document the eval split's long-context category uses."""
    docs = default_documents()
    assert {d.kind for d in docs} == {"prose", "code"}
    assert not {d.origin for d in docs} & eval_document_names()
    records, _ = build_tasks(docs, num=2 * len(TASKS), seed=0)
    assert Counter(r["category"] for r in records) == {c: 2 for c in TASKS}
    texts = {d.origin: d.text for d in docs}
    for r in records:
        n = len(prompt_ids(smollm2.tokenizer, [{"role": "user", "content": r["prompt"]}]))
        assert n >= 300, (r["category"], n)
        origin = r["source"].split("; ")[0]
        body = r["prompt"].split("\n\n", 1)[1]
        # the first passage's first lines are in its document (code pieces are dedented: compare stripped lines)
        head = [line.strip() for line in body.splitlines()[1:6] if line.strip() and not line.startswith("[")]
        assert head and all(line in texts[origin] for line in head), (r["category"], head)
        assert r["licence"]


def test_decontamination_drops_exact_and_near_duplicate_passages(tmp_path):
    """A document holding a list's article verbatim and one holding it with a few words changed are both dropped
    as matching the list; clean documents are kept. Negative control: without the lists the article gives a
    prompt."""
    path = tmp_path / "lists.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in LIST_RECORDS))
    guard, report = guard_for(["cnn_dailymail", "gsm8k"], {"cnn_dailymail": str(path), "gsm8k": str(path)})
    assert report["cnn_dailymail"]["checked"] and report["cnn_dailymail"]["texts"] == 5
    near = ARTICLE.replace("Tuesday", "Monday").replace("twelve", "ten").replace("northern", "eastern")
    assert guard.contaminated(near) and not guard.contaminated(_prose(1))
    docs = [_doc(ARTICLE, "exact"), _doc(near, "near")] + [_doc(_prose(i), f"clean{i}") for i in range(6)]
    records, dropped = build_tasks(docs, num=50, seed=0, guard=guard)
    used = " ".join(r["source"] for r in records)
    assert "exact" not in used and "near" not in used
    assert dropped["matches an evaluation text"] >= 2 and len(records) >= 4
    control, control_dropped = build_tasks(docs, num=50, seed=0, guard=None)
    assert "test exact" in {s for r in control for s in r["source"].split("; ")}
    assert "matches an evaluation text" not in control_dropped  # (near then goes as a near-duplicate of exact)


def test_a_source_without_a_list_is_one_message_and_none_is_said_explicitly(tmp_path):
    with pytest.raises(UserError) as err:
        declared_lists(["long_tasks", "registry20"], {"long_tasks": ["humaneval"]})
    msg = str(err.value)
    assert "'registry20' has no decontamination list" in msg and "+ship.decontaminate.registry20=none" in msg
    assert "+ship.decontaminate.registry20=[builtin_eval" in msg
    assert declared_lists(["a", "b"], {"a": ["gsm8k"], "b": "none"}) == {"a": ["gsm8k"], "b": "none"}
    with pytest.raises(UserError, match="'gsm8kk'.*is not"):
        declared_lists(["a"], {"a": ["gsm8kk"]})
    bad = tmp_path / "wmt.jsonl"
    bad.write_text('{"foo": 1}\n')
    with pytest.raises(UserError, match=r"record 0: no text field \(keys: \['foo'\]\)"):
        load_lists(["wmt"], {"wmt": str(bad)})


def test_answers_that_copy_from_the_input_score_high_and_others_low():
    """copy_share: an answer quoting its passage draws on the input; an unrelated one does not (negative control)."""
    passage = _prose(3).split()
    prompt = ["Summarise", "this:"] + passage
    quoting = passage[40:80] + ["in", "short"] + passage[200:230]
    unrelated = _prose(4).split()[:70]
    assert copy_share(prompt, quoting) > 0.8
    assert copy_share(prompt, unrelated) < 0.2
    assert copy_share(prompt, ["a"]) == 0.0


def test_code_pieces_start_at_a_definition():
    code = "".join(f"def f{i}(x):\n    y = x + {i}\n    return y * 2\n\n\n" for i in range(200))
    pieces = chunks(_doc(code, "m.py", "code"), random.Random(0))
    assert len(pieces) >= 3 and all(p.startswith("def f") for p in pieces)


def test_ship_data_manifest_records_the_lists_checked_and_not(tiny, tmp_path, cache_dir):
    """The real ship step on three long prompts answered by the tiny verifier: the manifest names each source's
    declared lists, which lists were checked (with the file's sha256) and which were not available, and the
    prompt builder's own record (licences, passage-level check)."""
    from helpers import compose_train
    from scripts.tools.ship_data import ship

    lists = tmp_path / "lists.jsonl"
    lists.write_text("".join(json.dumps(r) + "\n" for r in LIST_RECORDS))
    records, _ = build_tasks(default_documents(), num=3, seed=0)
    src = tmp_path / "long_tasks.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "long_tasks.jsonl.decontam.json").write_text(json.dumps({"licences": {"PSF-2.0": 3}}))
    out = tmp_path / "set"
    cfg = compose_train(["experiment=ship_data_long", "verifier=tiny", f"data.source=[{src}]", "data.generator=hf",
                         "data.max_new_tokens=3", "data.gen_batch_size=3", f"cache_dir={tmp_path / 'c'}",
                         f"ship.out={out}", "ship.name=t", f"ship.benchmarks.gsm8k={lists}"], tmp_path)
    cfg.verifier.cache_dir = cache_dir  # the tiny verifier's tokenizer is cached there
    ship(cfg)
    manifest = json.loads((out / "manifest.json").read_text())
    dec = manifest["decontaminated_against"]
    assert dec["declared_per_source"]["long_tasks"][:3] == ["builtin_eval", "humaneval", "mt_bench"]
    assert dec["lists"]["gsm8k"]["checked"] and len(dec["lists"]["gsm8k"]["sha256"]) == 64
    assert set(dec["not_available"]) >= {"cnn_dailymail", "wmt", "natural_questions"}
    assert "gsm8k" in dec["checked"] and "gsm8k" not in dec["not_available"]
    assert dec["source_builds"]["long_tasks"]["licences"] == {"PSF-2.0": 3}
    assert manifest["counts"]["conversations"] == 3
    assert set(manifest["by_source"]) == {"long_tasks"}
    # A list of sets (the short-prompt set and its long part) loads as one, each checked, in the order given.
    from data.shipped import load_shipped

    one, two = load_shipped(out, tiny), load_shipped([str(out), str(out)], tiny)
    assert len(two) == 6 and two["input_ids"][3:] == one["input_ids"]
    assert two._fingerprint == load_shipped([out, out], tiny)._fingerprint != one._fingerprint


def test_a_benchmark_passage_among_others_or_cut_or_holding_a_question_is_dropped():
    """Passages are checked one by one and by containment: a benchmark article as one of three retrieval passages
    (far from the whole prompt by Jaccard), a cut of a longer benchmark text, and a document that holds a benchmark
    question all go; with the same documents and no guard, they give prompts (negative control)."""
    article = _prose(7)
    guard = EvalGuard([article, LIST_RECORDS[0]["question"]])
    prompt = "\n\n".join([_prose(5), article, _prose(6)])
    assert not guard.contaminated(prompt) and guard.contaminated(article)
    cut = article[: len(article) // 3]
    assert not guard.contaminated(cut) and guard.overlaps(cut)
    holder = _prose(8)[:2000] + "\n\n" + LIST_RECORDS[0]["question"] + "\n\n" + _prose(8)[2000:4000]
    assert not guard.contaminated(holder) and guard.overlaps(holder) and not guard.overlaps(_prose(9))
    retrieval = {"long_retrieval": TASKS["long_retrieval"]}
    docs = [_doc(article, "bench")] + [_doc(_prose(10 + i), f"clean{i}") for i in range(5)]
    kept, dropped = build_tasks(docs, num=20, seed=0, guard=guard, tasks=retrieval)
    assert dropped.get("matches an evaluation text", 0) >= 1 and "bench" not in " ".join(r["source"] for r in kept)
    control, _ = build_tasks(docs, num=20, seed=0, tasks=retrieval)
    assert any("test bench" in r["source"] for r in control)
    single = {"long_summarise": TASKS["long_summarise"]}
    docs = [_doc(holder, "holder"), _doc(_prose(20), "clean")]
    question = LIST_RECORDS[0]["question"][:60]
    kept, _ = build_tasks(docs, num=5, seed=0, guard=guard, tasks=single)
    assert kept and not any(question in r["prompt"] for r in kept)
    control, _ = build_tasks(docs, num=5, seed=0, tasks=single)
    assert any(question in r["prompt"] for r in control)


def test_ship_data_keeps_the_prompts_as_the_verifier_renders_them(tmp_path, cache_dir):
    """A plain-rendering verifier (a base model: Gemma 3) sees shorter prompts than the chat template makes. ship_data
    keeps the rows the build kept by the verifier's own rendering: a prompt under max_length as plain text but over it
    through the chat template is packed, with plain ids (it was refused as 'the build and its sources differ')."""
    from helpers import compose_train
    from models.verifiers.tiny import build_tiny
    from scripts.tools.ship_data import ship

    tok = build_tiny(cache_dir=cache_dir).tokenizer
    text = "Summarise: " + _prose(3)[:300]
    messages = [{"role": "user", "content": text}]
    plain, chat = len(prompt_ids(tok, messages, "plain")), len(prompt_ids(tok, messages))
    assert plain < chat
    src = tmp_path / "long_tasks.jsonl"
    src.write_text(json.dumps({"id": "p1", "category": "summarise", "prompt": text}) + "\n")
    (tmp_path / "long_tasks.jsonl.decontam.json").write_text(json.dumps({"licences": {}}))
    out = tmp_path / "set"
    cfg = compose_train(["experiment=ship_data_long", "verifier=tiny", "+verifier.rendering=plain",
                         f"data.source=[{src}]", "data.generator=hf", "data.max_new_tokens=2",
                         f"data.max_length={plain + 2}", f"cache_dir={tmp_path / 'c'}", f"ship.out={out}",
                         "ship.name=t", "ship.decontaminate.long_tasks=none"], tmp_path)
    assert chat >= cfg.data.max_length > plain
    cfg.verifier.cache_dir = cache_dir
    ship(cfg)
    from data.shipped import load_shipped

    row = load_shipped(out, build_tiny(cache_dir=cache_dir, rendering="plain"))[0]
    assert row["input_ids"][:plain] == prompt_ids(tok, messages, "plain")
