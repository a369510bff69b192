"""Holds the fairseq user dir that ships inside the installed package (see :func:`softtopk_fairseq.user_dir`).

fairseq's ``--user-dir PATH`` puts PATH's parent -- this directory -- on ``sys.path`` and imports PATH's
basename, so this directory holds nothing but that one, uniquely named, package.
"""
