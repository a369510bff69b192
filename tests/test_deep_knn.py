"""The deep kNN example (examples/deep_knn/deep_knn.py): its kNN loss, and a smoke run of the whole script."""
import importlib.util
import os

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "deep_knn",
                      "deep_knn.py")


@pytest.fixture(scope="module")
def deep_knn():
    spec = importlib.util.spec_from_file_location("deep_knn_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _templates_around_query(same_label_nearest: bool):
    """One query at the origin and 8 templates on a line, 4 with its label (0) and 4 without; the same-label
    ones take either the 4 nearest or the 4 farthest positions."""
    query = torch.zeros(1, 2)
    positions = torch.arange(1.0, 9.0)
    template_features = torch.stack([positions, torch.zeros(8)], dim=1)
    near_labels, far_labels = torch.tensor([0, 0, 0, 0]), torch.tensor([1, 2, 3, 4])
    labels = torch.cat([near_labels, far_labels] if same_label_nearest else [far_labels, near_labels])
    return query, torch.tensor([0]), template_features, labels


@pytest.mark.parametrize("method", ["kNN + SOFT top-k", "kNN + softmax k times",
                                    "kNN + hard top-k, straight-through"])
def test_knn_loss_prefers_same_label_neighbours_and_reaches_the_features(deep_knn, method):
    relaxation = deep_knn.RELAXATIONS[method]
    losses = {}
    for same_label_nearest in (True, False):
        query, query_label, templates, template_labels = _templates_around_query(same_label_nearest)
        query.requires_grad_(True)
        templates.requires_grad_(True)
        loss = deep_knn.knn_loss(query, query_label, templates, template_labels, k=4, epsilon=1.0,
                                 relaxation=relaxation)
        loss.backward()
        assert torch.isfinite(query.grad).all() and query.grad.abs().sum() > 0, method
        assert torch.isfinite(templates.grad).all() and templates.grad.abs().sum() > 0, method
        losses[same_label_nearest] = loss.item()
    # The loss is minus the soft count of same-label templates among the 4 nearest: close to -4 when they are
    # the 4 nearest, close to 0 when they are the 4 farthest.
    assert losses[True] < -3.0 and losses[False] > -1.0, losses
    if method == "kNN + hard top-k, straight-through":
        assert losses == {True: -4.0, False: 0.0}  # its forward value is the hard count


def test_knn_loss_excludes_the_query_from_its_own_templates(deep_knn):
    query, query_label, templates, template_labels = _templates_around_query(same_label_nearest=False)
    # Make the query template 0 too: a sample at distance 0 with its own label.
    templates = torch.cat([query, templates])
    template_labels = torch.cat([query_label, template_labels])
    is_self = torch.zeros(1, 9, dtype=torch.bool)
    is_self[0, 0] = True
    with_self = deep_knn.knn_loss(query, query_label, templates, template_labels, k=4, epsilon=0.1)
    without_self = deep_knn.knn_loss(query, query_label, templates, template_labels, k=4, epsilon=0.1,
                                     template_is_query=is_self)
    assert with_self.item() < -0.9 and without_self.item() > -0.1


def test_knn_predict_majority_vote(deep_knn):
    train_features = torch.tensor([[0.0], [1.0], [2.0], [10.0], [11.0]])
    train_labels = torch.tensor([3, 3, 5, 5, 5])
    # Nearest 3 of 0.5 are 0, 1 (label 3) and 2 (label 5): label 3 wins, though label 5 is the majority overall.
    assert deep_knn.knn_predict(torch.tensor([[0.5]]), train_features, train_labels, k=3).tolist() == [3]
    with pytest.raises(ValueError, match="got 6"):
        deep_knn.knn_predict(torch.tensor([[0.5]]), train_features, train_labels, k=6)


def test_smoke_run_reports_every_method(deep_knn, tmp_path, capsys):
    pytest.importorskip("sklearn")
    json_path = tmp_path / "rows.jsonl"
    threads_before = torch.get_num_threads()
    rows = deep_knn.main(["--smoke", "--json", str(json_path)])
    assert torch.get_num_threads() == threads_before
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    header, body = table[0], table[1:]
    assert "test accuracy" in header
    assert [line.split("|")[1].strip() for line in body] == list(deep_knn.METHODS)
    for line in body:
        mean = float(line.split("|")[2].split("±")[0])
        assert 0.0 <= mean <= 100.0, line
    assert sorted(row["method"] for row in rows) == sorted(deep_knn.METHODS)
    assert all(0.0 <= row["test_accuracy"] <= 1.0 for row in rows), rows
    assert len(json_path.read_text().splitlines()) == len(deep_knn.METHODS)


def test_bad_options_are_refused_before_any_training(deep_knn, tmp_path, capsys, monkeypatch):
    """A --json folder that does not exist lost every result after the whole run; a template batch larger than the
    training set was refused only when the deep kNN runs began, after the other methods had trained."""
    for argv, said in [(["--json", str(tmp_path / "nodir" / "rows.jsonl")], "its folder does not exist"),
                       (["--lr", "-1"], "--lr must be > 0 and --weight-decay >= 0, got -1.0 and 0.0005")]:
        with pytest.raises(SystemExit):
            deep_knn.parse_args(argv)
        assert said in capsys.readouterr().err
    settings = deep_knn.parse_args(["--template-batch-size", "5000", "--k", "9"])
    monkeypatch.setattr(deep_knn, "load_digit_splits", lambda: {"train": {"labels": torch.zeros(1200)}})
    monkeypatch.setattr(deep_knn, "run_raw_pixel_knn", lambda *args: pytest.fail("trained before the check"))
    with pytest.raises(SystemExit, match="--template-batch-size must be at most the 1200 training images, got 5000"):
        deep_knn.run_all_methods(settings)
