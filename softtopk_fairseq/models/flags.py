"""Model flags written once, in a dataclass (help and default side by side), as fairseq's ``TransformerModel``
does: :func:`add_flags` generates the ``add_args`` flags from it, :func:`fill_defaults` is what an architecture
function does with it, :func:`register_architectures` registers a model's architectures that add such flags
to existing ones."""
from dataclasses import fields
from typing import Callable, Dict

from fairseq.dataclass import FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model_architecture


def add_flags(parser, config: FairseqDataclass) -> None:
    """The flags of ``config``'s fields, with their help and no parser default (fairseq's convention for model
    flags: the architecture functions set the defaults, so that a checkpoint's saved arguments keep their
    values)."""
    gen_parser_from_dataclass(parser, config, delete_default=True)


def fill_defaults(args, config: FairseqDataclass) -> None:
    """Each flag of ``config`` that ``args`` lacks, with ``config``'s value: the class's default, or an
    architecture's own when it passes an instance with other values. (``_name``, FairseqDataclass's own field, is
    no flag: fairseq names the model from ``--arch``.)"""
    for flag in fields(config):
        if not flag.name.startswith("_") and not hasattr(args, flag.name):
            setattr(args, flag.name, getattr(config, flag.name))


def register_architectures(model_name: str, config: FairseqDataclass, bases: Dict[str, Callable]) -> None:
    """Register one architecture of ``model_name`` per ``arch_name: base`` of ``bases``: ``config``'s defaults
    (:func:`fill_defaults`), then the existing architecture function ``base`` for everything else -- e.g. the
    top-k attention flags on top of each transformer size."""
    for arch_name, base in bases.items():
        def architecture(args, base=base):
            fill_defaults(args, config)
            base(args)

        architecture.__name__ = architecture.__qualname__ = arch_name
        architecture.__doc__ = f"``{base.__name__}`` with {type(config).__name__}'s defaults."
        register_model_architecture(model_name, arch_name)(architecture)
