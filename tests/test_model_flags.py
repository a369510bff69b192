"""The architectures' flags come from their dataclasses: fairseq's parser lists them with their help, each
architecture fills what the command line leaves out, and what it gives wins."""
import argparse

import pytest
from fairseq import options

import softtopk_fairseq.fairseq_plugin  # noqa: F401  (registers the architectures)
from softtopk_fairseq.models.rnnsearch import WMT14_EN_FR, RNNSearchConfig, RNNSearchModel
from softtopk_fairseq.models.topk_attention import TopkAttentionConfig

SIZES = ("encoder_embed_dim", "encoder_hidden_size", "decoder_embed_dim", "decoder_hidden_size", "attention_dim",
         "maxout_dim", "dropout")


def parse(tmp_path, arch, *flags):
    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, [str(tmp_path), "--arch", arch, *flags])


@pytest.mark.parametrize("arch, sizes", [("rnnsearch", (256, 256, 256, 512, 256, 256, 0.2)),
                                         ("rnnsearch_wmt14_en_fr", (620, 1000, 620, 1000, 1000, 500, 0.0)),
                                         ("rnnsearch_topk_attn", (256, 256, 256, 512, 256, 256, 0.2)),
                                         ("rnnsearch_topk_attn_wmt14_en_fr", (620, 1000, 620, 1000, 1000, 500, 0.0))])
def test_each_rnnsearch_architecture_fills_its_sizes_and_the_command_line_wins(tmp_path, arch, sizes):
    args = parse(tmp_path, arch)
    assert tuple(getattr(args, name) for name in SIZES) == sizes
    given = parse(tmp_path, arch, "--decoder-hidden-size", "7", "--dropout", "0.5")
    assert (given.decoder_hidden_size, given.dropout, given.attention_dim) == (7, 0.5, sizes[4])
    if "topk" in arch:  # the top-k attention flags' defaults, from their own dataclass
        assert (args.topk_attn_k, args.topk_attn_mode) == (TopkAttentionConfig.topk_attn_k, "soft")


def test_the_paper_sizes_and_the_defaults_are_one_dataclass():
    assert RNNSearchConfig().decoder_hidden_size == 512 and WMT14_EN_FR.decoder_hidden_size == 1000


def test_add_args_lists_each_rnnsearch_flag_with_its_help_and_no_parser_default():
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)  # as fairseq's model-specific group
    RNNSearchModel.add_args(parser)
    text = " ".join(parser.format_help().split())
    for flag, words in (("--encoder-hidden-size", "GRU size of each direction"), ("--maxout-dim", "max-out readout"),
                        ("--attention-dim", "alignment model size"), ("--dropout", "dropout probability")):
        assert f"{flag} " in text and words in text
    assert vars(parser.parse_args([])) == {}  # the architecture functions set the defaults, not the parser
    assert vars(parser.parse_args(["--maxout-dim", "3"])) == {"maxout_dim": 3}
