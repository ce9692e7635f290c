"""The curious cloud's attacks on what it holds: one token vector in, one token guess out.

Every attack takes boundary vectors (one per token position: ``[n, hidden]``, with each
vector's step and position in its sequence) and returns a guess per vector; the audit scores
the guesses against the edge's true tokens. Settings, in the cloud's shoes:

- *edge weights known* (a public checkpoint, or the seed of a layout-invariant init): the cloud
  pushes its own text through the same layers (a "shadow" run) and fits a linear probe from
  vectors to tokens. :func:`track` then follows the edge's weights as training moves them:
  each step it refits the probe on its own guesses of the steps before (self-training).
- *edge weights unknown*: a probe fitted on a differently-initialised shadow (it does not
  transfer), and :func:`decipher`: cluster the vectors (each cluster is mostly one token: the
  residual stream carries the embedding through), then read the clusters as a substitution
  cipher with the bigram statistics of the cloud's own text (Gibbs sampling with annealing,
  keeping the mapping with the highest likelihood; the cloud never sees a true token).
- labels, from the gradients the edge returns at the wraparound: the norm and direction
  attacks of Li et al., "Label Leakage and Protection in Two-party Split Learning" (ICLR
  2022), adapted to next-token labels (:func:`norm_auc`, :func:`nearest_direction`), and the
  same probes and decipherment as for inputs (a label is the next input token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class Vectors:
    """Token vectors at one boundary: ``x[i]`` (hidden), its ``step`` and ``position``. Whole
    sequences lie consecutively (``seq_length`` vectors each), as bigram statistics need."""

    x: torch.Tensor
    step: torch.Tensor
    position: torch.Tensor
    seq_length: int


# ---- linear probes ------------------------------------------------------------------------
@dataclass
class Probe:
    """Multinomial logistic regression on standardised vectors, over the classes it saw."""

    weight: torch.Tensor  # [hidden + 1, classes]
    mean: torch.Tensor
    std: torch.Tensor
    classes: torch.Tensor  # class index -> token id

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return _with_bias((x - self.mean) / self.std) @ self.weight

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.classes[self.logits(x).argmax(1)]


def _with_bias(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)


def fit_probe(x: torch.Tensor, tokens: torch.Tensor, *, iters: int = 60, l2: float = 1e-4,
              init: Optional[Probe] = None) -> Probe:
    """Fit (or, from ``init``, refit with its scaling and classes) a linear probe by L-BFGS."""
    if init is None:
        classes = torch.unique(tokens)
        mean, std = x.mean(0), x.std(0) + 1e-6
        weight = torch.zeros(x.shape[1] + 1, len(classes))
    else:
        classes, mean, std, weight = init.classes, init.mean, init.std, init.weight.clone()
    lookup = torch.full((int(max(classes.max(), tokens.max())) + 1,), -1, dtype=torch.long)
    lookup[classes] = torch.arange(len(classes))
    target = lookup[tokens]
    keep = target >= 0  # a token the probe has no class for cannot be learnt (refits only)
    inputs, target = _with_bias((x[keep] - mean) / std), target[keep]
    weight.requires_grad_(True)
    opt = torch.optim.LBFGS([weight], max_iter=iters, history_size=20,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(inputs @ weight, target) + l2 * weight[:-1].pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return Probe(weight.detach(), mean, std, classes)


def track(probe: Probe, victim: Vectors, *, window: int = 4, iters: int = 20) -> torch.Tensor:
    """Guess each step with the probe, then refit it on its own guesses of the last
    ``window`` steps: follows weights that training moves away from the known ones."""
    guesses = torch.empty(len(victim.x), dtype=torch.long)
    steps = sorted(set(victim.step.tolist()))
    for i, step in enumerate(steps):
        here = victim.step == step
        guesses[here] = probe.predict(victim.x[here])
        recent = torch.isin(victim.step, torch.tensor(steps[max(0, i + 1 - window):i + 1]))
        probe = fit_probe(victim.x[recent], guesses[recent], iters=iters, init=probe)
    return guesses


# ---- label attacks of Li et al. (2022), adapted to next-token labels ----------------------
def norm_auc(grads: torch.Tensor, labels: torch.Tensor, token: int) -> float:
    """Norm leak: AUC of "label is ``token``" (the cloud's most frequent token) scored by a
    small gradient norm (a well-predicted, frequent label gives a small gradient).
    0.5 is chance; Li et al. score the norm the same way for binary labels."""
    score = -grads.norm(dim=1)
    return auc(score, labels == token)


def auc(score: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half); NaN without both classes."""
    pos, neg = int(positive.sum()), int((~positive).sum())
    if not pos or not neg:
        return float("nan")
    order = torch.argsort(score)
    ranks = torch.empty(len(score), dtype=torch.float64)
    ranks[order] = torch.arange(1, len(score) + 1, dtype=torch.float64)
    uniq, inverse = torch.unique(score, return_inverse=True)  # average ranks over ties
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, ranks)
    counts = torch.bincount(inverse, minlength=len(uniq)).double()
    ranks = (sums / counts)[inverse]
    return float((ranks[positive].sum() - pos * (pos + 1) / 2) / (pos * neg))


def nearest_direction(shadow: torch.Tensor, shadow_labels: torch.Tensor,
                      grads: torch.Tensor) -> torch.Tensor:
    """Direction leak: the label whose mean shadow gradient direction is closest in cosine
    (Li et al. compare with a gradient of known label; here one reference per token)."""
    classes = torch.unique(shadow_labels)
    unit = F.normalize(shadow, dim=1)
    means = torch.stack([unit[shadow_labels == c].mean(0) for c in classes])
    return classes[(F.normalize(grads, dim=1) @ F.normalize(means, dim=1).T).argmax(1)]


# ---- unknown weights: clustering + decipherment --------------------------------------------
def cluster(v: Vectors, k: int, *, iters: int = 30, seed: int = 0) -> torch.Tensor:
    """k-means (k-means++ start) on per-position-centred, unit-length vectors. Centring per
    position removes the position embedding (the cloud knows each vector's position)."""
    x = v.x.clone()
    for p in torch.unique(v.position):
        at = v.position == p
        x[at] -= x[at].mean(0)
    x = F.normalize(x, dim=1)
    k = min(k, len(x))
    g = torch.Generator().manual_seed(seed)
    centres = [x[torch.randint(len(x), (1,), generator=g)]]
    dist = (x - centres[0]).pow(2).sum(1)
    for _ in range(k - 1):
        pick = torch.multinomial(dist / dist.sum(), 1, generator=g) if dist.sum() > 0 else \
            torch.randint(len(x), (1,), generator=g)
        centres.append(x[pick])
        dist = torch.minimum(dist, (x - x[pick]).pow(2).sum(1))
    c = torch.cat(centres)
    for _ in range(iters):
        assign = torch.cdist(x, c).argmin(1)
        sums = torch.zeros_like(c).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k)
        c = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], c)
    return torch.cdist(x, c).argmin(1)


@dataclass
class Language:
    """What the cloud knows of the language: its own text's token and bigram statistics,
    over its ``top`` most frequent tokens (the rest share one class that is never guessed)."""

    tokens: torch.Tensor  # [V] token ids, most frequent first
    unigram: torch.Tensor  # [V + 1]
    log_next: torch.Tensor  # [V + 1, V + 1] log P(next | current)

    @classmethod
    def of(cls, text_tokens: torch.Tensor, top: int = 128) -> "Language":
        counts = torch.bincount(text_tokens)
        tokens = counts.argsort(descending=True)[:top]
        tokens = tokens[counts[tokens] > 0]
        index = torch.full((len(counts),), len(tokens), dtype=torch.long)
        index[tokens] = torch.arange(len(tokens))
        ids = index[text_tokens]
        v = len(tokens) + 1
        pairs = torch.zeros(v, v, dtype=torch.float64)
        pairs.index_put_((ids[:-1], ids[1:]), torch.ones(len(ids) - 1, dtype=torch.float64),
                         accumulate=True)
        pairs += 0.01  # a pair the cloud never saw is rare, not impossible
        uni = torch.bincount(ids, minlength=v).double() + 0.01
        return cls(tokens, uni / uni.sum(), (pairs / pairs.sum(1, keepdim=True)).log())


def decipher(assign: torch.Tensor, seq_length: int, lang: Language, *, sweeps: int = 300,
             temperatures=(300.0, 1000.0), seed: int = 0) -> torch.Tensor:
    """Map clusters to tokens maximising the likelihood of the cluster sequences under the
    cloud's bigram model with one emission distribution per token (several clusters may
    share a token). Gibbs sampling, annealed from each starting temperature to ~0; the
    mapping with the highest likelihood wins. ``assign``: cluster ids of whole sequences in
    order (:class:`Vectors`). Returns the guessed token of every vector."""
    k = int(assign.max()) + 1
    rows = assign.reshape(-1, seq_length).numpy()
    pairs = np.zeros((k, k))
    np.add.at(pairs, (rows[:, :-1].reshape(-1), rows[:, 1:].reshape(-1)), 1.0)
    size = np.bincount(assign.numpy(), minlength=k).astype(np.float64)
    log_next = lang.log_next.numpy()
    v = len(log_next)
    diag = log_next.diagonal()

    def likelihood(m: np.ndarray) -> float:
        group = np.bincount(m, weights=size, minlength=v)
        return float((pairs * log_next[np.ix_(m, m)]).sum() - _xlogx(group).sum())

    rng = np.random.default_rng(seed)
    # start: clusters by size onto tokens by frequency (never onto the "rest" class)
    start = np.empty(k, dtype=np.int64)
    start[np.argsort(-size, kind="stable")] = np.arange(k) % (v - 1)
    best, best_score = start.copy(), likelihood(start)
    for t0 in temperatures:
        m = start.copy()
        group = np.bincount(m, weights=size, minlength=v)
        for sweep in range(sweeps):
            temp = t0 * (0.01 / t0) ** (sweep / max(1, sweeps - 1))
            for i in rng.permutation(k):
                # log-likelihood of each token for cluster i, the others fixed (its pairs with
                # itself counted once, at the token's own diagonal)
                old = m[i]
                score = (log_next[:, m] @ pairs[i] + pairs[:, i] @ log_next[m, :]
                         - pairs[i, i] * (log_next[:, old] + log_next[old, :]) + pairs[i, i] * diag)
                group[old] -= size[i]
                score -= _xlogx(group + size[i]) - _xlogx(group)
                score[-1] = -np.inf  # the "rest" class is no answer
                p = np.exp((score - score.max()) / temp)
                m[i] = rng.choice(v, p=p / p.sum())
                group[m[i]] += size[i]
            s = likelihood(m)
            if s > best_score:
                best, best_score = m.copy(), s
    return lang.tokens[torch.from_numpy(best)][assign]


def _xlogx(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, x * np.log(np.maximum(x, 1e-300)), 0.0)
