"""Tiny fairseq models and batches built in Python (no data files), for tests of the soft beam search."""
import argparse

import torch

import softtopk_fairseq.fairseq_plugin  # noqa: F401  (registers rnnsearch)
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

ARCHS = ("lstm", "transformer", "rnnsearch")
TINY = dict(encoder_embed_dim=8, decoder_embed_dim=8, encoder_hidden_size=8, decoder_hidden_size=8,
            decoder_out_embed_dim=8, encoder_layers=1, decoder_layers=1, encoder_ffn_embed_dim=16,
            decoder_ffn_embed_dim=16, encoder_attention_heads=2, decoder_attention_heads=2, attention_dim=8,
            maxout_dim=8)


class TinyTask:
    def __init__(self, dictionary):
        self.source_dictionary = self.target_dictionary = dictionary


def dictionary(n_words=16):
    d = Dictionary()
    for i in range(n_words):
        d.add_symbol(f"w{i}")
    return d


def build(arch, d, seed=0, dtype=torch.float64, dropout=0.0, **extra):
    torch.manual_seed(seed)
    args = argparse.Namespace(arch=arch, criterion="cross_entropy", dropout=dropout, max_source_positions=64,
                              max_target_positions=64, **TINY, **extra)
    ARCH_CONFIG_REGISTRY[arch](args)
    model = ARCH_MODEL_REGISTRY[arch].build_model(args, TinyTask(d)).to(dtype)
    # fairseq's tiny initialisations give near-uniform outputs; sharpen them so beams are well separated.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model


def batch(d, bsz=3, src_len=5, tgt_lens=(4, 3, 5), seed=1):
    """A left-padded source batch and right-padded targets of the given lengths (incl. eos)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = d.nspecial, len(d)
    src = torch.randint(lo, hi, (bsz, src_len), generator=g)
    src_lengths = torch.full((bsz,), src_len)
    src[-1, :2] = d.pad()  # left padding, like fairseq's translation task
    src_lengths[-1] = src_len - 2
    T = max(tgt_lens)
    target = torch.full((bsz, T), d.pad())
    prev = torch.full((bsz, T), d.pad())
    for b, n in enumerate(tgt_lens[:bsz]):
        words = torch.randint(lo, hi, (n - 1,), generator=g)
        target[b, : n - 1] = words
        target[b, n - 1] = d.eos()
        prev[b, 0] = d.eos()
        prev[b, 1:n] = words
    ntokens = int(target.ne(d.pad()).sum())
    return {"id": torch.arange(bsz), "nsentences": bsz, "ntokens": ntokens, "target": target,
            "net_input": {"src_tokens": src, "src_lengths": src_lengths, "prev_output_tokens": prev}}
