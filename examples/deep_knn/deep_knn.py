r"""Deep kNN trained end to end through a relaxed top-k (Xie et al., NeurIPS 2020, Table 1, App. C and I.1),
on scikit-learn's handwritten digits (1,797 8x8 images shipped inside the scikit-learn package: no download).

The kNN loss
------------
A network :math:`f_\theta` maps an image to a feature vector. For a query :math:`Z_j` with label :math:`y_j`
and a batch of template samples :math:`Z_1..Z_T` (a separate random batch of training images, the query itself
excluded when drawn) the similarities are negative squared Euclidean distances

.. math::  x_{jt} = -\lVert f_\theta(Z_t) - f_\theta(Z_j) \rVert_2^2 ,

a relaxed top-k of the row gives :math:`A_j = \mathrm{topk}_\varepsilon(x_{j\cdot}) \in [0,1]^T` with
:math:`\sum_t A_{jt} = k`, and the loss of the query is minus the soft count of same-label templates among its
k nearest,

.. math::  \ell(Z_j, y_j) = -\,Y_j^\top Y_{\setminus j}^\top A_j = -\sum_{t:\ y_t = y_j} A_{jt},
           \qquad \mathcal{L} = \frac{1}{B} \sum_{j=1}^{B} \ell(Z_j, y_j).

The paper (App. C) writes :math:`\ell = Y_j^\top Y_{\setminus j}^\top A^\varepsilon_{\setminus j}` -- the soft
count itself, which training maximises -- and builds the scores from distances that are selected smallest;
minimising its negative over negated squared distances selected largest is the same objective.

The relaxations compared (same k, epsilon, network, optimiser and batches):

* SOFT top-k: ``softtopk_fairseq.ops.soft_topk(x, k, epsilon=EPS)`` (unsorted OT relaxation);
* softmax k times: ``softtopk_fairseq.ops.softmax_k_times(x, k, epsilon=EPS)`` summed over its k rank columns;
* hard top-k, straight-through: the forward pass uses the hard top-k mask, the backward pass the gradient of
  :math:`k\,\mathrm{softmax}(x_{j\cdot}/\varepsilon)` (``A = hard + s - s.detach()``). The loss is linear in
  :math:`A`, so a straight-through estimator trains exactly like its backward surrogate (the forward value never
  enters the gradient): with SOFT top-k as the surrogate it would repeat the SOFT top-k run step for step, which
  is why the surrogate here is a softmax.

Prediction is plain kNN, as in the paper: majority vote of the k nearest training features (squared Euclidean
distance; a tie goes to the lowest label) computed with the trained network.

Baselines: kNN on raw pixels; the same network trained with cross-entropy (its feature extractor followed by
ReLU and a linear layer, as the paper's f_theta excludes "the final activation layer and the linear layer"),
scored both by its own softmax and by kNN on its features (the paper's two-stage "pretrained CNN").

Protocol
--------
* Split: stratified, ``random_state=0``: 1,200 train / 300 validation / 297 test. Pixels scaled to [0, 1].
* The split is fixed; the seeds (``--seeds``) set the network initialisation and the batch order.
* Validation is used only for early stopping: every trained method is scored on it after each epoch and the
  parameters of its best epoch (the earliest, on a tie) are the ones tested. kNN on validation/test uses the
  1,200 training images as the neighbours.
* Network: conv(1->32, 3x3) ReLU maxpool2, conv(32->64, 3x3) ReLU maxpool2, linear(256 -> 64) = features.
* Training: Adam (lr 1e-3, weight decay 5e-4), 100 queries per step with 100 templates drawn at random
  from the training split (the paper's batch sizes, App. I Table 3; it uses SGD).
* Every trained method runs the same number of epochs (``--epochs``, default 50).
* k = 9 (the paper's App. I value) for training and prediction; epsilon = 1 (``--epsilon``) in the units of the
  scores (``scaling="none"``), for all three relaxations. The paper's epsilon (1e-3 on MNIST) is relative to
  the largest cost of a row (``scaling="paper"``), so the values are not comparable. The features are not
  normalised: the network can sharpen every relaxation by spreading its features out (weight decay resists).

Usage::

    python examples/deep_knn/deep_knn.py                      # 3 seeds, all methods, markdown table on stdout
    python examples/deep_knn/deep_knn.py --json results.jsonl # also one JSON line per method and seed
    python examples/deep_knn/deep_knn.py --smoke              # one seed, a few batches (for tests)
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from softtopk_fairseq.ops import soft_topk, softmax_k_times

NUM_CLASSES = 10
SPLIT_RANDOM_STATE = 0
VAL_SIZE = 300
TEST_SIZE = 297

METHOD_RAW_KNN = "kNN, raw pixels"
METHOD_PRETRAINED_KNN = "kNN + CE-pretrained CNN features"
METHOD_CE_SOFTMAX = "CNN + CE (softmax classifier)"
METHOD_SOFT_TOPK = "kNN + SOFT top-k"
METHOD_SOFTMAX_K = "kNN + softmax k times"
METHOD_HARD_ST = "kNN + hard top-k, straight-through"
METHODS = (METHOD_RAW_KNN, METHOD_PRETRAINED_KNN, METHOD_CE_SOFTMAX, METHOD_SOFT_TOPK, METHOD_SOFTMAX_K,
           METHOD_HARD_ST)


# ----------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------

def load_digit_splits() -> Dict[str, Dict[str, Tensor]]:
    """The fixed stratified train/val/test split of scikit-learn's digits, images as (n, 1, 8, 8) in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
    labels = torch.tensor(digits.target, dtype=torch.long)
    indices = list(range(len(labels)))
    rest, test = train_test_split(indices, test_size=TEST_SIZE, stratify=digits.target,
                                  random_state=SPLIT_RANDOM_STATE)
    train, val = train_test_split(rest, test_size=VAL_SIZE, stratify=digits.target[rest],
                                  random_state=SPLIT_RANDOM_STATE)
    return {name: {"images": images[idx], "labels": labels[idx]}
            for name, idx in (("train", train), ("val", val), ("test", test))}


# ----------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------

class DigitFeatureNet(nn.Module):
    """The feature extractor f_theta: two conv blocks and a linear layer, no final activation."""

    def __init__(self, feature_dim: int = 64):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 8x8 -> 4x4
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 4x4 -> 2x2
            nn.Flatten(), nn.Linear(64 * 2 * 2, feature_dim))

    def forward(self, images: Tensor) -> Tensor:
        return self.body(images)


class DigitClassifier(nn.Module):
    """f_theta followed by the activation and linear layer that the kNN models leave out."""

    def __init__(self, feature_dim: int = 64):
        super().__init__()
        self.features = DigitFeatureNet(feature_dim)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(feature_dim, NUM_CLASSES))

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.features(images))


# ----------------------------------------------------------------------------------------------------------
# kNN prediction and the kNN loss
# ----------------------------------------------------------------------------------------------------------

def knn_predict(query_features: Tensor, train_features: Tensor, train_labels: Tensor, k: int) -> Tensor:
    """Majority vote of the k nearest training features (squared Euclidean); ties go to the lowest label."""
    if not 1 <= k <= len(train_labels):
        raise ValueError(f"knn_predict: k must be in 1..{len(train_labels)} (the number of training samples), "
                         f"got {k}")
    distances = torch.cdist(query_features, train_features)
    nearest = distances.topk(k, dim=1, largest=False).indices
    votes = F.one_hot(train_labels[nearest], NUM_CLASSES).sum(dim=1)
    return votes.argmax(dim=1)  # argmax returns the first maximum: the lowest label among tied classes


def knn_accuracy(query_features: Tensor, query_labels: Tensor, train_features: Tensor, train_labels: Tensor,
                 k: int) -> float:
    predictions = knn_predict(query_features, train_features, train_labels, k)
    return (predictions == query_labels).float().mean().item()


def negative_squared_distances(query_features: Tensor, template_features: Tensor) -> Tensor:
    """(queries, templates) similarities -||f(q) - f(t)||^2, differentiable in both feature sets."""
    # The expanded form (q.q - 2 q.t + t.t) can go slightly negative; the direct difference is exact and the
    # batches are small.
    return -(query_features.unsqueeze(1) - template_features.unsqueeze(0)).pow(2).sum(-1)


def soft_topk_indicator(scores: Tensor, k: int, epsilon: float, mask: Tensor) -> Tensor:
    return soft_topk(scores, k, epsilon=epsilon, mask=mask)


def softmax_k_times_indicator(scores: Tensor, k: int, epsilon: float, mask: Tensor) -> Tensor:
    # (queries, templates, k) soft rank indicators -> summing the ranks gives the soft top-k membership.
    return softmax_k_times(scores, k, epsilon=epsilon, mask=mask).sum(dim=-1)


def hard_topk_straight_through_indicator(scores: Tensor, k: int, epsilon: float, mask: Tensor) -> Tensor:
    """Forward: the hard top-k mask; backward: the gradient of ``k * softmax(scores / epsilon)`` (which, like
    the indicator, sums to k over the allowed entries)."""
    logits = (scores / epsilon).masked_fill(~mask, -torch.inf)
    surrogate = k * torch.softmax(logits, dim=1)
    hard = torch.zeros_like(surrogate).scatter_(1, logits.detach().topk(k, dim=1).indices, 1.0)
    return hard + surrogate - surrogate.detach()


RELAXATIONS: Dict[str, Callable[[Tensor, int, float, Tensor], Tensor]] = {
    METHOD_SOFT_TOPK: soft_topk_indicator,
    METHOD_SOFTMAX_K: softmax_k_times_indicator,
    METHOD_HARD_ST: hard_topk_straight_through_indicator,
}


def knn_loss(query_features: Tensor, query_labels: Tensor, template_features: Tensor, template_labels: Tensor,
             k: int, epsilon: float, relaxation: Callable[[Tensor, int, float, Tensor], Tensor] = soft_topk_indicator,
             template_is_query: Optional[Tensor] = None) -> Tensor:
    """Mean over queries of minus the relaxed count of same-label templates among the query's k nearest.

    ``template_is_query``: optional (queries, templates) bool, True where a template is the query itself; those
    pairs are excluded from the top-k (a sample is not its own neighbour).
    """
    num_templates = template_features.shape[0]
    if not 1 <= k < num_templates:
        raise ValueError(f"knn_loss: k must be in 1..{num_templates - 1} (fewer than the {num_templates} "
                         f"templates), got {k}")
    scores = negative_squared_distances(query_features, template_features)
    allowed = torch.ones_like(scores, dtype=torch.bool) if template_is_query is None else ~template_is_query
    indicator = relaxation(scores, k, epsilon, allowed)
    same_label = (query_labels.unsqueeze(1) == template_labels.unsqueeze(0)).to(indicator.dtype)
    return -(indicator * same_label).sum(dim=1).mean()


# ----------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------

class TrainingSettings(argparse.Namespace):
    """The parsed command line (typed for readers; argparse fills it)."""

    seeds: List[int]
    epochs: int
    batch_size: int
    template_batch_size: int
    max_batches_per_epoch: Optional[int]
    threads: int
    k: int
    epsilon: float
    lr: float
    weight_decay: float
    json: Optional[str]
    smoke: bool


@torch.no_grad()
def embed(network: nn.Module, images: Tensor) -> Tensor:
    network.eval()
    features = network(images)
    network.train()
    return features


def query_batches(num_samples: int, batch_size: int, generator: torch.Generator,
                  max_batches: Optional[int]) -> List[Tensor]:
    batches = list(torch.randperm(num_samples, generator=generator).split(batch_size))
    return batches if max_batches is None else batches[:max_batches]


def train_with_early_stopping(network: nn.Module, step_loss: Callable[[Tensor, torch.Generator], Tensor],
                              validation_accuracy: Callable[[], float], num_train: int,
                              settings: TrainingSettings, generator: torch.Generator, label: str) -> Dict:
    """Adam over shuffled query batches; keeps the parameters of the epoch with the best validation accuracy."""
    optimizer = torch.optim.Adam(network.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    best = {"val_accuracy": -1.0, "epoch": 0, "state": None}
    for epoch in range(1, settings.epochs + 1):
        losses = []
        for batch in query_batches(num_train, settings.batch_size, generator, settings.max_batches_per_epoch):
            loss = step_loss(batch, generator)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        val_accuracy = validation_accuracy()
        if val_accuracy > best["val_accuracy"]:
            best = {"val_accuracy": val_accuracy, "epoch": epoch, "state": copy.deepcopy(network.state_dict())}
        print(f"  {label} epoch {epoch}: loss {statistics.fmean(losses):.4f}, val acc {val_accuracy:.4f}",
              file=sys.stderr)
    network.load_state_dict(best["state"])
    return {"val_accuracy": best["val_accuracy"], "best_epoch": best["epoch"]}


def run_cross_entropy(data: Dict, settings: TrainingSettings, seed: int) -> List[Dict]:
    """One CE training; scored by its softmax and by kNN on its features (two rows)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    classifier = DigitClassifier()
    train, val, test = data["train"], data["val"], data["test"]

    def step_loss(batch: Tensor, _generator: torch.Generator) -> Tensor:
        return F.cross_entropy(classifier(train["images"][batch]), train["labels"][batch])

    def softmax_accuracy(split: Dict) -> float:
        return (embed(classifier, split["images"]).argmax(1) == split["labels"]).float().mean().item()

    start = time.perf_counter()
    report = train_with_early_stopping(classifier, step_loss, lambda: softmax_accuracy(val), len(train["labels"]),
                                       settings, generator, f"{METHOD_CE_SOFTMAX} seed {seed}")
    seconds = time.perf_counter() - start
    train_features = embed(classifier.features, train["images"])
    rows = [
        dict(method=METHOD_CE_SOFTMAX, seed=seed, test_accuracy=softmax_accuracy(test), train_seconds=seconds,
             **report),
        # Two-stage: the features of the network chosen by its own (softmax) validation accuracy.
        dict(method=METHOD_PRETRAINED_KNN, seed=seed,
             test_accuracy=knn_accuracy(embed(classifier.features, test["images"]), test["labels"],
                                        train_features, train["labels"], settings.k),
             val_accuracy=knn_accuracy(embed(classifier.features, val["images"]), val["labels"],
                                       train_features, train["labels"], settings.k),
             best_epoch=report["best_epoch"], train_seconds=seconds),
    ]
    return rows


def run_deep_knn(method: str, data: Dict, settings: TrainingSettings, seed: int) -> Dict:
    """Train f_theta with the kNN loss under ``method``'s relaxation; score it by plain kNN."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    network = DigitFeatureNet()
    relaxation = RELAXATIONS[method]
    train, val, test = data["train"], data["val"], data["test"]
    num_train = len(train["labels"])  # (at least --template-batch-size: run_all_methods checks it)

    def step_loss(queries: Tensor, generator: torch.Generator) -> Tensor:
        templates = torch.randperm(num_train, generator=generator)[:settings.template_batch_size]
        features = network(train["images"][torch.cat([queries, templates])])
        return knn_loss(features[:len(queries)], train["labels"][queries], features[len(queries):],
                        train["labels"][templates], settings.k, settings.epsilon, relaxation,
                        template_is_query=queries.unsqueeze(1) == templates.unsqueeze(0))

    def accuracy(split: Dict) -> float:
        return knn_accuracy(embed(network, split["images"]), split["labels"], embed(network, train["images"]),
                            train["labels"], settings.k)

    start = time.perf_counter()
    report = train_with_early_stopping(network, step_loss, lambda: accuracy(val), num_train, settings, generator,
                                       f"{method} seed {seed}")
    return dict(method=method, seed=seed, test_accuracy=accuracy(test), train_seconds=time.perf_counter() - start,
                **report)


def run_raw_pixel_knn(data: Dict, k: int, seed: int) -> Dict:
    train, val, test = data["train"], data["val"], data["test"]
    flat = {name: split["images"].flatten(1) for name, split in data.items()}
    return dict(method=METHOD_RAW_KNN, seed=seed,
                test_accuracy=knn_accuracy(flat["test"], test["labels"], flat["train"], train["labels"], k),
                val_accuracy=knn_accuracy(flat["val"], val["labels"], flat["train"], train["labels"], k),
                best_epoch=0, train_seconds=0.0)


# ----------------------------------------------------------------------------------------------------------
# Reporting and entry point
# ----------------------------------------------------------------------------------------------------------

def markdown_table(rows: Sequence[Dict]) -> str:
    lines = ["| method | test accuracy (mean ± std) | per seed |", "|---|---|---|"]
    for method in METHODS:
        accuracies = [row["test_accuracy"] for row in rows if row["method"] == method]
        if not accuracies:
            continue
        spread = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        per_seed = ", ".join(f"{100 * a:.1f}" for a in accuracies)
        lines.append(f"| {method} | {100 * statistics.fmean(accuracies):.1f} ± {100 * spread:.1f} % | {per_seed} |")
    return "\n".join(lines)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks and shows every option's default."""


def parse_args(argv: Optional[Sequence[str]]) -> TrainingSettings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="seeds for initialisation and batch order (the split is fixed)")
    parser.add_argument("--epochs", type=int, default=50, help="training epochs of every trained method")
    parser.add_argument("--k", type=int, default=9, help="neighbours, for the kNN loss and for prediction")
    parser.add_argument("--epsilon", type=float, default=1.0,
                        help="relaxation temperature, in the units of the negative squared distances")
    parser.add_argument("--batch-size", type=int, default=100, help="query samples per step")
    parser.add_argument("--template-batch-size", type=int, default=100, help="template samples per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--weight-decay", type=float, default=5e-4, help="Adam weight decay")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads; the tensors are small, so one thread per process is fastest "
                             "and does not spin against other processes on the machine")
    parser.add_argument("--json", metavar="PATH", help="write one JSON line per method and seed to PATH")
    parser.add_argument("--smoke", action="store_true",
                        help="one seed, one epoch of two batches: checks that everything runs")
    settings = parser.parse_args(argv, namespace=TrainingSettings())
    settings.max_batches_per_epoch = None
    if settings.smoke:
        settings.seeds, settings.epochs, settings.max_batches_per_epoch = settings.seeds[:1], 1, 2
    if settings.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {settings.epochs}")
    if not 1 <= settings.k < settings.template_batch_size:
        parser.error(f"--k must be in 1..{settings.template_batch_size - 1} (below --template-batch-size), "
                     f"got {settings.k}")
    if settings.epsilon <= 0:
        parser.error(f"--epsilon must be positive, got {settings.epsilon}")
    if settings.threads < 1:
        parser.error(f"--threads must be at least 1, got {settings.threads}")
    if settings.batch_size < 1:
        parser.error(f"--batch-size must be at least 1, got {settings.batch_size}")
    if not settings.lr > 0 or not settings.weight_decay >= 0:
        parser.error(f"--lr must be > 0 and --weight-decay >= 0, got {settings.lr} and {settings.weight_decay}")
    if settings.json and not os.path.isdir(os.path.dirname(os.path.abspath(settings.json))):
        parser.error(f"--json {settings.json}: its folder does not exist")
    return settings


def main(argv: Optional[Sequence[str]] = None) -> List[Dict]:
    settings = parse_args(argv)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        return run_all_methods(settings)
    finally:
        torch.set_num_threads(threads_before)  # main() also runs in-process (tests); leave the caller's setting


def run_all_methods(settings: TrainingSettings) -> List[Dict]:
    data = load_digit_splits()
    num_train = len(data["train"]["labels"])
    if settings.template_batch_size > num_train:  # (before any training: the deep kNN runs come last)
        raise SystemExit(f"--template-batch-size must be at most the {num_train} training images, "
                         f"got {settings.template_batch_size}")
    if settings.json:
        open(settings.json, "w").close()  # each seed's rows are appended as it ends
    rows: List[Dict] = []
    for seed in settings.seeds:
        print(f"seed {seed}: {METHOD_RAW_KNN}", file=sys.stderr)
        rows.append(run_raw_pixel_knn(data, settings.k, seed))
        print(f"seed {seed}: {METHOD_CE_SOFTMAX} / {METHOD_PRETRAINED_KNN}", file=sys.stderr)
        rows.extend(run_cross_entropy(data, settings, seed))
        for method in RELAXATIONS:
            print(f"seed {seed}: {method}", file=sys.stderr)
            rows.append(run_deep_knn(method, data, settings, seed))
        for row in rows:
            if row["seed"] == seed:
                print(f"seed {seed}: {row['method']}: test accuracy {row['test_accuracy']:.4f} "
                      f"(best epoch {row['best_epoch']}, {row['train_seconds']:.1f} s)", file=sys.stderr)
        if settings.json:
            with open(settings.json, "a") as out:
                for row in rows:
                    if row["seed"] == seed:
                        out.write(json.dumps(dict(row, k=settings.k, epsilon=settings.epsilon,
                                                  epochs=settings.epochs)) + "\n")
    print(markdown_table(rows))
    return rows


if __name__ == "__main__":
    main()
