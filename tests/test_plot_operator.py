"""The Figure 3 / Figure 7 script: its data has the properties the pictures claim, and it writes both files."""
import pytest
import torch

from softtopk_fairseq.tools import plot_operator


def test_figure7_gradient_pushes_the_chosen_scores_up_and_the_others_down():
    d = plot_operator.figure7_data(plot_operator.FIG7_INDEX_SETS, epsilon=1.0, scaling="none")
    for index, grad in zip(d["index_sets"], d["grads"]):
        inside = torch.zeros(10, dtype=torch.bool)
        inside[index] = True
        assert (grad[inside] > 0).all() and (grad[~inside] < 0).all()
        # Raising every score by the same amount changes nothing (the operator is shift-invariant).
        assert abs(float(grad.sum())) < 1e-8


def test_figure7_with_the_papers_scaling_pushes_the_largest_score_down():
    # The temperature grows with the cost range, so raising x_9 smooths A and lowers A_7 + A_8 + A_9.
    (grad,) = plot_operator.figure7_data([[7, 8, 9]], epsilon=0.1, scaling="paper")["grads"]
    assert grad[9] < 0 < grad[8]


def test_figure3_data_sharpens_as_epsilon_falls():
    d = plot_operator.figure3_data([1e-3, 1e-1], "paper")
    for eps in (1e-3, 1e-1):
        assert torch.allclose(d["sorted"][eps].sum(-1), torch.ones(50, dtype=torch.float64), atol=1e-6)
        assert abs(float(d["unsorted"][eps].sum()) - 5) < 1e-6
    hard = torch.zeros(50, dtype=torch.float64)
    hard[:5] = 1  # x is sorted decreasingly
    err = {eps: float((d["unsorted"][eps] - hard).abs().sum()) for eps in (1e-3, 1e-1)}
    assert err[1e-3] < 0.25 * err[1e-1]  # not ~0: two of the 50 scores nearly tie at ranks 5 and 6


def test_plot_operator_writes_both_figures(tmp_path):
    paths = plot_operator.main(["--out", str(tmp_path), "--epsilons", "0.01", "0.1"])
    for path in paths.values():
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_attention_keeps_matplotlib_debug_lines_out(tmp_path, caplog):
    """fairseq leaves the root logger at DEBUG: drawing must not flood the terminal with matplotlib's records."""
    import logging

    import torch

    from softtopk_fairseq.tools import plot_attention

    logging.getLogger().setLevel(logging.DEBUG)
    with caplog.at_level(logging.DEBUG):
        plot_attention.plot({"softmax": torch.rand(3, 4), "soft_topk": torch.rand(3, 4)}, list("abcd"), list("xyz"),
                            str(tmp_path / "a.png"))
    assert (tmp_path / "a.png").exists()
    assert not [r for r in caplog.records if r.name.startswith("matplotlib") and r.levelno < logging.WARNING]


def test_plot_attention_draws_every_attention_mode(tmp_path):
    """One panel per mode the layers have (the attention's relaxations), the perturbed one included."""
    import torch

    from softtopk_fairseq.modules import relaxations
    from softtopk_fairseq.tools import plot_attention

    plot_attention.plot({mode: torch.rand(3, 4) for mode in relaxations.names("attention")}, list("abcd"), list("xyz"), str(tmp_path / "a.png"))
    assert (tmp_path / "a.png").exists()



@pytest.mark.parametrize("tool", ["plot_attention", "plot_operator"])
def test_every_command_a_tools_docstring_shows_parses(tool):
    """The usage lines at the top of a tool's ``--help`` are commands its parser takes."""
    import importlib
    import shlex

    module = importlib.import_module(f"softtopk_fairseq.tools.{tool}")
    prog = f"python -m softtopk_fairseq.tools.{tool}"
    lines = module.__doc__.replace("\\\n", " ").splitlines()  # a command continued with a backslash: one line
    commands = [line.split(prog, 1)[1] for line in lines if prog in line]
    assert commands, f"{tool}: no usage line in its docstring"
    for command in commands:
        module.parser().parse_args(shlex.split(command))


def test_plot_attention_takes_the_modes_earlier_names_and_refuses_others(capsys, monkeypatch):
    from softtopk_fairseq.modules import relaxations
    from softtopk_fairseq.tools import plot_attention

    monkeypatch.setattr(relaxations, "_warned", set())
    required = ["--path", "c", "--data", "d"]
    with pytest.warns(FutureWarning) as warned:
        args = plot_attention.parser().parse_args(required + ["--modes", "softmax", "soft", "hard"])
    assert args.modes == ["softmax", "soft_topk", "hard_topk"]
    renamed = [("soft", "soft_topk"), ("hard", "hard_topk")]
    assert [str(w.message) for w in warned] == [
        f"plot_attention --modes: {old!r} is the old name of {new!r}; it will be removed" for old, new in renamed]
    with pytest.raises(SystemExit):
        plot_attention.parser().parse_args(required + ["--modes", "sparsemax"])
    assert "plot_attention --modes must be one of" in capsys.readouterr().err


def test_plot_attention_refuses_a_bad_index_or_out_path_and_warns_of_unknown_words(capsys, monkeypatch, tmp_path,
                                                                                    caplog):
    """A missing --out folder failed after the model had run; --index past the subset was an IndexError; words not
    in the model's vocabulary were drawn as <unk> without a word."""
    import logging

    from fairseq.data import Dictionary

    from softtopk_fairseq.tools import plot_attention

    monkeypatch.setattr(plot_attention, "load", lambda *args: pytest.fail("the model was loaded first"))
    with pytest.raises(SystemExit):
        plot_attention.main(["--path", "c", "--data", "d", "--out", str(tmp_path / "nodir" / "a.png")])
    assert "--out" in capsys.readouterr().err

    class Task:
        source_dictionary = target_dictionary = Dictionary()

        def load_dataset(self, subset):
            pass

        def dataset(self, subset):
            return [{"source": None, "target": None}] * 3

    Task.source_dictionary.add_symbol("a")
    with pytest.raises(SystemExit, match="--index 3: --subset test has sentences 0..2"):
        plot_attention.sentence_pair(Task(), "test", 3, None, None)
    with caplog.at_level(logging.WARNING):
        plot_attention.sentence_pair(Task(), None, 0, "a Zebra", "a")
    assert "not in the model's vocabulary, drawn as <unk>: Zebra" in caplog.text
