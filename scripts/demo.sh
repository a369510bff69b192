#!/usr/bin/env bash
# Set up .venv on first use, then run the offline demo pipeline (toy en->fr corpus by default).
# Arguments go to `python -m softtopk_fairseq.pipeline` (see --help), e.g. real data:
#   bash scripts/demo.sh --train ../shared/data/multi30k_en_fr/train --valid ../shared/data/multi30k_en_fr/val \
#       --test ../shared/data/multi30k_en_fr/test_2016_flickr --workdir work/multi30k
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup_env.sh"
exec "$root/.venv/bin/python" -m softtopk_fairseq.pipeline "$@"
