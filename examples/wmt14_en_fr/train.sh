#!/usr/bin/env bash
# Teacher-forcing pre-training of the paper's model (App. I.2): RNNsearch (Bahdanau et al. 2014) at the
# WMT14 en-fr size, SGD at learning rate 1, x0.1 every 1e5 updates from update 5e5, 1e6 updates.
#
#   bash examples/wmt14_en_fr/train.sh DEST SAVE_DIR [extra fairseq-train arguments]
#
# DEST is prepare.py's --dest. Extra arguments come last, so they override anything here
# (e.g. --max-update 200000 --update-freq 4, or --cpu and tiny sizes for a smoke test).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if [ $# -lt 2 ]; then usage; exit 2; fi
DEST=$1; SAVE_DIR=$2; shift 2
need_dir "$DEST/bin" "run prepare.py first"

"$PYTHON" -m fairseq_cli.train "$DEST/bin" --user-dir "$USER_DIR" \
    --arch rnnsearch_wmt14_en_fr --dropout 0.3 \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
    --optimizer sgd --lr 1.0 --clip-norm 5.0 --lr-scheduler manual \
    --update2lr "{'1': 1.0, '500000': 0.1, '600000': 0.01, '700000': 0.001, '800000': 1e-4, '900000': 1e-5}" \
    --max-update 1000000 --max-tokens 4096 --batch-size 80 "${KEEP_LAST_BATCH[@]}" \
    --save-dir "$SAVE_DIR" --save-interval-updates 10000 --keep-interval-updates 5 --no-epoch-checkpoints \
    --log-format simple --log-interval 100 \
    "$@"
