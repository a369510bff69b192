#!/usr/bin/env bash
# Beam search with fairseq-generate, then detokenised sacrebleu against the untouched references.
#
#   bash examples/wmt14_en_fr/evaluate.sh DEST CHECKPOINT [extra fairseq-generate arguments]
#
# Environment: SUBSET=test|valid (default test), BEAM (default 5), OUT (where hypotheses and the log go;
# default: next to the checkpoint). Prints the sacrebleu line; the bare score is in OUT/SUBSET.beamBEAM.bleu.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if [ $# -lt 2 ]; then sed -n 2,8p "$0"; exit 2; fi
DEST=$1; CHECKPOINT=$2; shift 2
SUBSET=${SUBSET:-test}; BEAM=${BEAM:-5}; OUT=${OUT:-$(dirname "$CHECKPOINT")}
need_dir "$DEST/bin" "run prepare.py first"
mkdir -p "$OUT"
if [ -f "$DEST/bpe/spm.model" ]; then REMOVE_BPE=sentencepiece; else REMOVE_BPE="@@ "; fi
NAME="$OUT/$SUBSET.beam$BEAM"

"$PYTHON" -m fairseq_cli.generate "$DEST/bin" --user-dir "$USER_DIR" --path "$CHECKPOINT" \
    --gen-subset "$SUBSET" --beam "$BEAM" --batch-size 128 --remove-bpe "$REMOVE_BPE" \
    --max-len-a 1.5 --max-len-b 10 "${KEEP_LAST_BATCH[@]}" "$@" > "$NAME.log" 2>&1 \
    || { tail -n 30 "$NAME.log" >&2; echo "error: fairseq-generate failed (log: $NAME.log)" >&2; exit 1; }
# Hypotheses in corpus order; subword-nmt output is Moses-tokenised, sentencepiece output is raw text.
grep '^H-' "$NAME.log" | sed 's/^H-//' | sort -n -k1,1 | cut -f3 > "$NAME.tok.fr"
if [ "$REMOVE_BPE" = sentencepiece ]; then
    cp "$NAME.tok.fr" "$NAME.fr"
else
    "$PYTHON" -m sacremoses -l fr -j 1 detokenize < "$NAME.tok.fr" > "$NAME.fr"
fi
N_HYP=$(wc -l < "$NAME.fr"); N_REF=$(wc -l < "$DEST/ref/$SUBSET.fr")
if [ "$N_HYP" -ne "$N_REF" ]; then
    echo "error: $N_HYP hypotheses for $N_REF references (see $NAME.log)" >&2; exit 1
fi
"$PYTHON" -m sacrebleu "$DEST/ref/$SUBSET.fr" -i "$NAME.fr" -m bleu -w 2 | tee "$NAME.sacrebleu.json"
"$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["score"])' "$NAME.sacrebleu.json" > "$NAME.bleu"
