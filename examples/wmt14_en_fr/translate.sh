#!/usr/bin/env bash
# Beam search with fairseq-generate: detokenised hypotheses, one line per source line, in corpus order.
#
#   bash examples/wmt14_en_fr/translate.sh DEST CHECKPOINT [extra fairseq-generate arguments]
#
# Environment: SUBSET (default test), BEAM (default 5), OUT (where hypotheses and the log go; default: next to
# the checkpoint), BIN (the binarized data; default DEST/bin, or prepare.py --sources-only's DEST/sources/NAME/bin).
# Writes OUT/SUBSET.beamBEAM.TGT (TGT: the prepared data's target language) -- for another BIN, such as
# DEST/sources/NAME/bin, OUT/NAME.SUBSET.beamBEAM.TGT (NAME: the folder BIN is in), leaving the test set's in
# place -- and prints its path.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if [ $# -lt 2 ]; then usage; exit 2; fi
DEST=$1; CHECKPOINT=$2; shift 2
SUBSET=${SUBSET:-test}; BEAM=${BEAM:-5}; OUT=${OUT:-$(dirname "$CHECKPOINT")}; BIN=${BIN:-$DEST/bin}
need_dir "$DEST/bin" "run prepare.py first"
need_file "$CHECKPOINT" "a checkpoint train.sh or finetune_soft_beam.sh wrote"
need_dir "$BIN" "run prepare.py --sources-only first"
prepared_languages "$DEST"
mkdir -p "$OUT"
if [ -f "$DEST/bpe/spm.model" ]; then REMOVE_BPE=sentencepiece; else REMOVE_BPE="@@ "; fi
if [ "$BIN" -ef "$DEST/bin" ]; then NAME="$OUT/$SUBSET.beam$BEAM"
else NAME="$OUT/$(basename "$(dirname "$(realpath "$BIN")")").$SUBSET.beam$BEAM"; fi

"$PYTHON" -m fairseq_cli.generate "$BIN" --user-dir "$USER_DIR" --path "$CHECKPOINT" \
    --source-lang "$SRC" --target-lang "$TGT" --gen-subset "$SUBSET" --beam "$BEAM" --batch-size 128 \
    --remove-bpe "$REMOVE_BPE" --max-len-a 1.5 --max-len-b 10 "${KEEP_LAST_BATCH[@]}" "$@" > "$NAME.log" 2>&1 \
    || { tail -n 30 "$NAME.log" >&2; echo "error: fairseq-generate failed (log: $NAME.log)" >&2; exit 1; }
# Hypotheses in corpus order; subword-nmt output is Moses-tokenised, sentencepiece output is raw text.
grep '^H-' "$NAME.log" | sed 's/^H-//' | sort -n -k1,1 | cut -f3 > "$NAME.tok.$TGT"
if [ "$REMOVE_BPE" = sentencepiece ]; then
    cp "$NAME.tok.$TGT" "$NAME.$TGT"
else
    "$PYTHON" -m sacremoses -l "$TGT" -j 1 detokenize < "$NAME.tok.$TGT" > "$NAME.$TGT"
fi
N_HYP=$(wc -l < "$NAME.$TGT")
N_SRC=$(grep -c '^S-' "$NAME.log" || true)
if [ "$N_HYP" -ne "$N_SRC" ]; then
    echo "error: $N_HYP hypotheses for $N_SRC sources (see $NAME.log)" >&2; exit 1
fi
echo "$NAME.$TGT"
