#!/usr/bin/env bash
# The top-k attention variant (App. I.3): the same model trained from scratch with SOFT top-k attention,
# w = softmax(s + log A_eps(s)), k 4 keys per query (the paper does not give its k), epsilon 0.1.
# Same schedule as train.sh, so the two are comparable update for update.
#
#   bash examples/wmt14_en_fr/train_topk_attn.sh DEST SAVE_DIR [extra fairseq-train arguments]
#
# --topk-attn-mode hard_topk gives the hard top-k baseline; --topk-attn-inference hard_topk|softmax changes decoding
# (fairseq-generate: --model-overrides "{'topk_attn_inference': 'hard_topk'}").
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if [ $# -lt 2 ]; then usage; exit 2; fi
DEST=$1; SAVE_DIR=$2; shift 2

bash "$RECIPE_DIR/train.sh" "$DEST" "$SAVE_DIR" --arch rnnsearch_topk_attn_wmt14_en_fr \
    --topk-attn-k 4 --topk-attn-epsilon 0.1 --topk-attn-mode soft_topk \
    "$@"
