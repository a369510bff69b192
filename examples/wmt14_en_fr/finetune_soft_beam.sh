#!/usr/bin/env bash
# Soft beam-search fine-tuning of a teacher-forcing checkpoint (App. D and I.2): L = rho L_tf + (1-rho) L_SOFT
# with rho 0.8, beam 5, epsilon 0.1 (the authors' normalisation of the cost), SGD at learning rate 0.05
# for 1e5 updates, fresh optimizer and counters. Run again with the same SAVE_DIR, it resumes from its
# checkpoint_last.pt (--finetune-from-model reads PRETRAINED only while SAVE_DIR has none).
#
#   bash examples/wmt14_en_fr/finetune_soft_beam.sh DEST PRETRAINED_CHECKPOINT SAVE_DIR [extra arguments]
#
# Extra arguments come last and override these (e.g. --teacher-forcing-ratio 0.9 --soft-beam-epsilon 0.05,
# --soft-beam-relaxation softmax_k_times for the Goyal et al. baseline, or the sizes the checkpoint was trained with).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if [ $# -lt 3 ]; then usage; exit 2; fi
DEST=$1; PRETRAINED=$2; SAVE_DIR=$3; shift 3
need_dir "$DEST/bin" "run prepare.py first"
if [ ! -f "$PRETRAINED" ]; then echo "error: checkpoint $PRETRAINED not found (run train.sh first)" >&2; exit 2; fi

"$PYTHON" -m fairseq_cli.train "$DEST/bin" --user-dir "$USER_DIR" \
    --arch rnnsearch_wmt14_en_fr --dropout 0.3 \
    --finetune-from-model "$PRETRAINED" \
    --criterion soft_beam_search --label-smoothing 0.1 --teacher-forcing-ratio 0.8 \
    --soft-beam-size 5 --soft-beam-epsilon 0.1 --soft-beam-scaling paper --soft-beam-candidates 50 \
    --optimizer sgd --lr 0.05 --clip-norm 5.0 --lr-scheduler fixed \
    --max-update 100000 --max-tokens 4096 --batch-size 80 "${KEEP_LAST_BATCH[@]}" \
    --save-dir "$SAVE_DIR" --save-interval-updates 10000 --keep-interval-updates 5 --no-epoch-checkpoints \
    --log-format simple --log-interval 100 \
    "$@"
