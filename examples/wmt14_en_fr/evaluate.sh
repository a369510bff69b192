#!/usr/bin/env bash
# Beam search with fairseq-generate (translate.sh), then detokenised sacrebleu against the untouched references.
#
#   bash examples/wmt14_en_fr/evaluate.sh DEST CHECKPOINT [extra fairseq-generate arguments]
#
# Environment: SUBSET=test|valid (default test), BEAM (default 5), OUT (where hypotheses and the log go;
# default: next to the checkpoint). Prints the sacrebleu line; the bare score is in OUT/SUBSET.beamBEAM.bleu.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if [ $# -lt 2 ]; then usage; exit 2; fi
DEST=$1; CHECKPOINT=$2
SUBSET=${SUBSET:-test}; BEAM=${BEAM:-5}; OUT=${OUT:-$(dirname "$CHECKPOINT")}
need_dir "$DEST/bin" "run prepare.py first"
prepared_languages "$DEST"
need_file "$DEST/ref/$SUBSET.$TGT" "SUBSET is test or valid, the sets with references"
HYP=$(SUBSET=$SUBSET BEAM=$BEAM OUT=$OUT BIN="$DEST/bin" bash "$RECIPE_DIR/translate.sh" "$@")
REF="$DEST/ref/$SUBSET.$TGT"; NAME="$OUT/$SUBSET.beam$BEAM"
N_HYP=$(wc -l < "$HYP"); N_REF=$(wc -l < "$REF")
if [ "$N_HYP" -ne "$N_REF" ]; then
    echo "error: $N_HYP hypotheses for $N_REF references (see $NAME.log)" >&2; exit 1
fi
"$PYTHON" -m sacrebleu "$REF" -i "$HYP" -m bleu -w 2 | tee "$NAME.sacrebleu.json"
"$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["score"])' "$NAME.sacrebleu.json" > "$NAME.bleu"
