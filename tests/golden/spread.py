"""How far the golden cases move on other CPUs, measured on this one: every case of ``cases.py`` recomputed in a
fresh process under settings that take the code paths other x86-64 CPUs take -- torch's vector kernels at a lower
level (``ATEN_CPU_CAPABILITY``), MKL's (``MKL_ENABLE_INSTRUCTIONS``), the C kernels built for another ``-march``
(``SOFTTOPK_CPU_ARCH``) -- and compared with ``golden.pt``: per case, the largest difference relative to each
tensor's group's largest magnitude (what ``test_golden.TOLERANCE`` bounds), and the tensor where it is. Run from the
repository root:

    TRITON_INTERPRET=1 PYTHONPATH=tests .venv/bin/python tests/golden/spread.py [--cases criterion ...]
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# Each setting: the environment of one run (added to this process's).
SETTINGS = {
    "aten default": {"ATEN_CPU_CAPABILITY": "default"},
    "aten avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "mkl avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "C x86-64": {"SOFTTOPK_CPU_ARCH": "x86-64"},
    "C x86-64-v3": {"SOFTTOPK_CPU_ARCH": "x86-64-v3"},
    "all at avx2 level": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                          "SOFTTOPK_CPU_ARCH": "x86-64-v3"},
}


def relative_differences(case: str, golden_path: str) -> dict:
    """{tensor name: (|got - recorded| max / the scale of its group, abs max)} of ``case`` in this process
    (``test_golden.group_scales``)."""
    import torch

    sys.path.insert(0, os.path.dirname(HERE))
    from golden.cases import CASES, computed
    from test_golden import group_scales

    golden = torch.load(golden_path)
    got = computed(CASES[case])
    scales = group_scales({name: golden[name] for name in got})
    found = {}
    for name, value in got.items():
        recorded = golden[name]
        finite = torch.isfinite(recorded) & torch.isfinite(value)
        diff = (value[finite].double() - recorded[finite].double()).abs()
        worst = diff.max().item() if diff.numel() else 0.0
        found[name] = (worst / scales[name] if scales[name] else worst, worst)
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=None)
    p.add_argument("--golden", default=os.path.join(HERE, "golden.pt"), help="the recorded values compared with")
    p.add_argument("--one", help=argparse.SUPPRESS)  # (the child process: one case, JSON on stdout)
    args = p.parse_args()
    if args.one:
        print(json.dumps(relative_differences(args.one, args.golden)))
        return
    sys.path.insert(0, os.path.dirname(HERE))
    from golden.cases import CASES

    env_base = dict(os.environ, TRITON_INTERPRET="1", SOFTTOPK_CACHE_DIR=os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "softtopk_spread_cache"))
    print("| case | setting | max relative difference | in | max abs difference |\n|---|---|---|---|---|")
    for case in args.cases or list(CASES):
        for label, env in {"this machine": {}, **SETTINGS}.items():
            out = subprocess.run([sys.executable, __file__, "--one", case, "--golden", args.golden],
                                 env={**env_base, **env},
                                 capture_output=True, text=True, check=True).stdout
            found = json.loads(out.strip().splitlines()[-1])
            name, (rel, _) = max(found.items(), key=lambda item: item[1][0])
            worst_abs = max(a for _, a in found.values())
            print(f"| {case} | {label} | {rel:.2e} | {name} | {worst_abs:.2e} |", flush=True)


if __name__ == "__main__":
    main()
