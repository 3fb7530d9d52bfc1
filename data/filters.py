"""Prompt filters for generated and downloaded prompts: degenerate text, near-duplicates, and eval contamination.

Every filter returns what it kept and prints how many it dropped and why, so a user sees what a source lost:
- length: fewer than `min_words` or more than `max_words` words;
- repetition: more than `max_repeat` of the word 3-grams are repeats (a model looping on a phrase);
- language: fewer than `min_latin` of the letters are Latin, or (6+ words) no common English function word;
- near-duplicates: word-shingle Jaccard similarity >= `threshold` to a prompt kept earlier (MinHash LSH finds the
  candidate pairs, the exact Jaccard decides), so the first of each cluster stays;
- eval contamination: exact (normalised) or near-duplicate matches of the evaluation prompts (the built-in eval
  split, HumanEval, and any MT-bench-style files given) are dropped from every training source.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

_WORD = re.compile(r"\w+", re.UNICODE)
_ENGLISH = {"the", "a", "an", "of", "to", "in", "and", "or", "is", "are", "be", "for", "on", "with", "what", "how",
            "i", "you", "my", "me", "can", "do", "it", "this", "that", "your", "we", "please", "about", "why", "which"}
_PRIME = 4294967291  # the largest prime below 2^32: (a * h + b) mod p with a, b, h < p fits in uint64


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def normalise(text: str) -> str:
    return " ".join(words(text))


def shingles(text: str, n: int = 3) -> set[str]:
    """Word n-grams of `text` (the whole text as one shingle when it is shorter than n words)."""
    w = words(text)
    if len(w) < n:
        return {" ".join(w)}
    return {" ".join(w[i : i + n]) for i in range(len(w) - n + 1)}


def jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / max(1, len(a | b))


def repeated_fraction(text: str, n: int = 3) -> float:
    """Fraction of the word n-grams of `text` that repeat an earlier one (0 for text shorter than n words)."""
    w = words(text)
    grams = [tuple(w[i : i + n]) for i in range(len(w) - n + 1)]
    return 0.0 if not grams else 1.0 - len(set(grams)) / len(grams)


def latin_fraction(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return 1.0 if not letters else sum(c.isascii() or "\u00c0" <= c <= "\u024f" for c in letters) / len(letters)


@dataclass(frozen=True)
class QualityFilter:
    min_words: int = 3
    max_words: int = 300
    max_repeat: float = 0.3
    min_latin: float = 0.9
    english: bool = True

    def reason(self, text: str) -> str | None:
        """Why `text` is dropped, or None to keep it."""
        w = words(text)
        if latin_fraction(text) < self.min_latin:
            return "non-Latin script"
        if len(w) < self.min_words:
            return "too short"
        if len(w) > self.max_words:
            return "too long"
        if repeated_fraction(text) > self.max_repeat:
            return "repeated n-grams"
        if self.english and len(w) >= 6 and not _ENGLISH & set(w):
            return "not English"
        return None


class MinHashIndex:
    """MinHash signatures over word shingles with banded LSH (hand-rolled: a few thousand prompts need no library).

    `num_perm` = bands x rows; two sets of Jaccard s become candidates with probability 1 - (1 - s^rows)^bands
    (16 bands x 4 rows: 0.99 at s = 0.7, 0.12 at s = 0.3); candidates are then checked with the exact Jaccard.
    """

    def __init__(self, num_perm: int = 64, bands: int = 16, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, _PRIME, num_perm, dtype=np.uint64)
        self.b = rng.integers(0, _PRIME, num_perm, dtype=np.uint64)
        self.bands, self.rows = bands, num_perm // bands
        self.buckets: list[dict[bytes, list[int]]] = [{} for _ in range(bands)]
        self.sets: list[set[str]] = []

    def signature(self, sh: set[str]) -> np.ndarray:
        h = np.array([int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") % _PRIME
                      for s in sh], dtype=np.uint64)
        return ((self.a[:, None] * h[None, :] + self.b[:, None]) % _PRIME).min(axis=1)  # (num_perm,)

    def _keys(self, sig: np.ndarray) -> list[bytes]:
        return [sig[i * self.rows : (i + 1) * self.rows].tobytes() for i in range(self.bands)]

    def query(self, sh: set[str], threshold: float) -> int | None:
        """The index of a stored set with Jaccard >= threshold to `sh`, or None."""
        seen: set[int] = set()
        for band, key in zip(self.buckets, self._keys(self.signature(sh))):
            for j in band.get(key, ()):
                if j not in seen:
                    seen.add(j)
                    if jaccard(sh, self.sets[j]) >= threshold:
                        return j
        return None

    def add(self, sh: set[str]) -> int:
        j = len(self.sets)
        self.sets.append(sh)
        for band, key in zip(self.buckets, self._keys(self.signature(sh))):
            band.setdefault(key, []).append(j)
        return j


def near_duplicates(texts: Sequence[str], threshold: float = 0.7) -> list[int]:
    """Indices of the texts to keep: each one whose shingle Jaccard to an earlier kept text is below threshold."""
    index, keep = MinHashIndex(), []
    for i, t in enumerate(texts):
        sh = shingles(t)
        if index.query(sh, threshold) is None:
            index.add(sh)
            keep.append(i)
    return keep


def count_clusters(texts: Sequence[str], threshold: float = 0.5) -> int:
    """Number of near-duplicate clusters (greedy, first member as centre): a diversity measure."""
    return len(near_duplicates(texts, threshold))


def distinct_ngrams(texts: Iterable[str], n: int = 4) -> float:
    """Distinct word n-grams / all word n-grams over a set of texts (distinct-n, Li et al. 2016)."""
    grams = [tuple(w[i : i + n]) for t in texts for w in [words(t)] for i in range(len(w) - n + 1)]
    return len(set(grams)) / max(1, len(grams))


class EvalGuard:
    """The evaluation prompts, to drop exact and near-duplicate copies of them from training data."""

    def __init__(self, eval_texts: Iterable[str], threshold: float = 0.7) -> None:
        self.exact = set()
        self.index, self.threshold = MinHashIndex(seed=1), threshold
        self._postings: dict[str, list[int]] | None = None
        for t in eval_texts:
            self.exact.add(normalise(t))
            self.index.add(shingles(t))

    def contaminated(self, text: str) -> bool:
        return normalise(text) in self.exact or self.index.query(shingles(text), self.threshold) is not None

    def overlaps(self, text: str, threshold: float | None = None) -> bool:
        """Containment either way, for long texts where Jaccard misses it: `threshold` (default: the guard's) or
        more of `text`'s word 3-grams are in one eval text (a cut of a benchmark article), or of one eval text's
        3-grams are in `text` (a benchmark question inside a longer document)."""
        threshold = self.threshold if threshold is None else threshold
        sets = self.index.sets
        if self._postings is None:  # built on first use: shingle -> the eval texts holding it
            self._postings = {}
            for j, sh in enumerate(sets):
                for g in sh:
                    self._postings.setdefault(g, []).append(j)
        mine = shingles(text)
        shared: dict[int, int] = {}
        for g in mine:
            for j in self._postings.get(g, ()):
                shared[j] = shared.get(j, 0) + 1
        return any(n >= threshold * len(mine) or n >= threshold * len(sets[j]) for j, n in shared.items())


def apply_filters(texts: Sequence[str], quality: QualityFilter | None, guard: EvalGuard | None,
                  dedup_threshold: float | None, name: str) -> list[int]:
    """Indices of `texts` that pass quality, eval decontamination and near-duplicate removal; prints the counts."""
    dropped: dict[str, int] = {}
    kept = []
    for i, t in enumerate(texts):
        why = quality.reason(t) if quality else None
        if why is None and guard is not None and guard.contaminated(t):
            why = "matches an eval prompt"
        if why is None:
            kept.append(i)
        else:
            dropped[why] = dropped.get(why, 0) + 1
    if dedup_threshold is not None:
        unique = near_duplicates([texts[i] for i in kept], dedup_threshold)
        if len(unique) < len(kept):
            dropped[f"near-duplicate (Jaccard >= {dedup_threshold})"] = len(kept) - len(unique)
        kept = [kept[j] for j in unique]
    detail = ", ".join(f"{k}: {v}" for k, v in dropped.items()) or "none dropped"
    print(f"[data] filter {name}: {len(texts)} in, {len(kept)} kept ({detail})")
    return kept
