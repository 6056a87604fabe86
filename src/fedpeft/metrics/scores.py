"""Evaluation scores as pure functions. All are fractions in [0, 1] (MCC in [-1, 1])."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def accuracy(pred: Sequence[int], gold: Sequence[int]) -> float:
    pred, gold = np.asarray(pred), np.asarray(gold)
    return float((pred == gold).mean()) if len(gold) else 0.0


def macro_f1(pred: Sequence[int], gold: Sequence[int]) -> float:
    """Mean F1 over the classes present in gold or pred (sklearn's average='macro')."""
    from sklearn.metrics import f1_score

    return float(f1_score(gold, pred, average="macro", zero_division=0))


def mcc(pred: Sequence[int], gold: Sequence[int]) -> float:
    """Matthews correlation (multi-class generalisation), the GLUE metric of CoLA."""
    from sklearn.metrics import matthews_corrcoef

    return float(matthews_corrcoef(gold, pred))


def binary_f1(pred: Sequence[int], gold: Sequence[int]) -> float:
    """F1 of class 1 (GLUE's F1 for MRPC and QQP, where 1 = paraphrase / duplicate)."""
    from sklearn.metrics import f1_score

    return float(f1_score(gold, pred, average="binary", pos_label=1, zero_division=0))


def classification_scores(pred: Sequence[int], gold: Sequence[int], num_labels: int | None = None) -> dict[str, float]:
    """accuracy, macro_f1, mcc; for two-class tasks also f1 (of class 1) and acc_and_f1, their mean (the
    number GLUE reports for MRPC)."""
    out = {"accuracy": accuracy(pred, gold), "macro_f1": macro_f1(pred, gold), "mcc": mcc(pred, gold)}
    if num_labels == 2:
        out["f1"] = binary_f1(pred, gold)
        out["acc_and_f1"] = (out["accuracy"] + out["f1"]) / 2
    return out


def accuracy_interval(value: float, rows: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of an accuracy measured on ``rows`` rows (scipy's binomial test): how far a score
    on a few rows can be from the model's true accuracy."""
    from scipy.stats import binomtest

    ci = binomtest(round(value * rows), rows).proportion_ci(level, method="wilson")
    return float(ci.low), float(ci.high)


ONE_CLASS_SHARE = 0.95  # a model that gives one class to this share of the rows is "predicting one class"


def one_class(pred: Sequence[int], gold: Sequence[int]) -> tuple[int, float] | None:
    """(the class, its share of the predictions) when at least ONE_CLASS_SHARE of the predictions are one class
    while the gold labels are spread wider (their most common class holds less than that share), else None: a
    model that learned the class balance, not the task, whose accuracy is about the majority class's share."""
    pred, gold = np.asarray(pred), np.asarray(gold)
    if not len(pred) or not len(gold):
        return None
    classes, counts = np.unique(pred, return_counts=True)
    share = counts.max() / len(pred)
    if share < ONE_CLASS_SHARE or np.unique(gold, return_counts=True)[1].max() / len(gold) >= ONE_CLASS_SHARE:
        return None
    return int(classes[counts.argmax()]), float(share)


def one_class_label(pred: Sequence[int], gold: Sequence[int],
                    label_names: Sequence[str] | None) -> tuple[str, float] | None:
    """:func:`one_class` with the class by its name (by its id where the data names none)."""
    found = one_class(pred, gold)
    if found is None:
        return None
    cls, share = found
    return (label_names[cls] if label_names and cls < len(label_names) else str(cls)), share


def one_class_advice(metric: str) -> str:
    """What to do about a one-class model, for a run judged by ``metric``."""
    if metric.removeprefix("personal_") in ("mcc", "macro_f1"):
        return f"{metric} scores such a model low, so it is kept as the best only when no round did better"
    return (f"its {metric} reflects the class balance, not the task; judge the run (and pick best_adapter) by a "
            "metric that scores such a model low: task.metric: mcc (0 for one class, chance-corrected) or macro_f1")


def rouge(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F-measure (rouge-score, with stemming); for several references, the best one
    counts (``RougeScorer.score_multi``)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for pred, refs in zip(predictions, references):
        scores = scorer.score_multi(list(refs), pred)
        for k in totals:
            totals[k] += scores[k].fmeasure
    n = max(len(predictions), 1)
    return {k: v / n for k, v in totals.items()}


def choice_scores(
    logprob: np.ndarray, example_index: np.ndarray, choice_chars: np.ndarray, gold: np.ndarray
) -> dict[str, float]:
    """Multiple-choice accuracy from per-choice log-likelihoods, as lm-evaluation-harness reports it:
    ``accuracy`` picks the choice with the highest summed log-likelihood, ``accuracy_norm`` the one
    with the highest log-likelihood per character of the choice."""
    pick, pick_norm = choice_picks(logprob, example_index, choice_chars, len(gold))
    return {"accuracy": accuracy(pick, gold), "accuracy_norm": accuracy(pick_norm, gold)}


def choice_picks(logprob: np.ndarray, example_index: np.ndarray, choice_chars: np.ndarray,
                 n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per example, the index of the choice with the highest summed log-likelihood and with the highest
    log-likelihood per character."""
    best = np.full(n, -np.inf)
    best_norm = np.full(n, -np.inf)
    pick = np.full(n, -1)
    pick_norm = np.full(n, -1)
    position = np.zeros(n, dtype=np.int64)
    for lp, ex, chars in zip(logprob, example_index, choice_chars):
        j = position[ex]
        position[ex] += 1
        if lp > best[ex]:
            best[ex], pick[ex] = lp, j
        norm = lp / max(int(chars), 1)
        if norm > best_norm[ex]:
            best_norm[ex], pick_norm[ex] = norm, j
    return pick, pick_norm
