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
        assert (args.topk_attn_k, args.topk_attn_mode) == (TopkAttentionConfig.topk_attn_k, "soft_topk")


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


BASES = {"transformer_topk_attn": "transformer", "transformer_topk_attn_iwslt_de_en": "transformer_iwslt_de_en",
         "transformer_topk_attn_wmt_en_de": "transformer_wmt_en_de",
         "transformer_topk_attn_vaswani_wmt_en_de_big": "transformer_vaswani_wmt_en_de_big",
         "lstm_topk_attn": "lstm", "rnnsearch_topk_attn": "rnnsearch",
         "rnnsearch_topk_attn_wmt14_en_fr": "rnnsearch_wmt14_en_fr"}


def test_every_topk_architecture_is_its_base_architecture_plus_the_topk_flags():
    """Each ``*_topk_attn*`` architecture (models.flags.register_architectures) sets exactly what its base
    architecture sets, and the top-k flags' defaults besides; none is missing from the registry."""
    from dataclasses import fields

    from fairseq.models import ARCH_CONFIG_REGISTRY

    from softtopk_fairseq.models.topk_attention import TransformerTopkAttentionConfig

    assert sorted(name for name in ARCH_CONFIG_REGISTRY if "topk_attn" in name) == sorted(BASES)
    for arch, base in BASES.items():
        args, base_args = argparse.Namespace(), argparse.Namespace()
        ARCH_CONFIG_REGISTRY[arch](args)
        ARCH_CONFIG_REGISTRY[base](base_args)
        topk = {name: value for name, value in vars(args).items() if name.startswith("topk_attn")}
        assert {name: value for name, value in vars(args).items() if name not in topk} == vars(base_args), arch
        config = TransformerTopkAttentionConfig if arch.startswith("transformer") else TopkAttentionConfig
        assert topk == {f.name: f.default for f in fields(config) if not f.name.startswith("_")}, arch
