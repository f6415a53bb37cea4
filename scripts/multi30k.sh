#!/usr/bin/env bash
# The Multi30k De->En recipe (README, "Real data: Multi30k"): train a small Transformer with the
# paper's recipe, average the last checkpoints, export, translate both Flickr test sets with the
# paper's decoding (beam 4, alpha 0.6, max length source + 50) and score them with sacreBLEU.
#
#   bash scripts/multi30k.sh                      # data from ../shared/corpora/multi30k
#   DATA=/path/to/multi30k bash scripts/multi30k.sh
#
# DATA holds train/val/test_2016_flickr/test_2017_flickr .de/.en (.gz or plain), as published at
# github.com/multi30k/dataset (data/task1/raw). Rerunning resumes training where it stopped.
# On a GPU machine add e.g. EXTRA="--precision bf16" or run training under torchrun.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=${DATA:-../shared/corpora/multi30k}
RUN=${RUN:-runs/multi30k}
MODEL=${MODEL:-runs/multi30k-model}
STEPS=${STEPS:-3200}
AVERAGE=${AVERAGE:-5}
EXTRA=${EXTRA:-}

pick() {  # the .gz file if present, else the plain one
    if [ -f "$DATA/$1.gz" ]; then echo "$DATA/$1.gz"; else echo "$DATA/$1"; fi
}

# shellcheck disable=SC2086
pipeline train --train-src "$(pick train.de)" --train-tgt "$(pick train.en)" \
    --valid-src "$(pick val.de)" --valid-tgt "$(pick val.en)" --save-dir "$RUN" \
    --preset small --vocab-size 8000 --batch-tokens 4000 --warmup 800 --lr-scale 0.8 \
    --max-steps "$STEPS" --save-every 200 --keep-last 10 --valid-every 400 --valid-max-sentences 300 $EXTRA

pipeline average "$RUN" --last "$AVERAGE"
pipeline export "$RUN" --out "$MODEL" --force

for split in test_2016_flickr test_2017_flickr; do
    pipeline serve-batch "$MODEL" "$(pick $split.de)" --output "$RUN/$split.hyp" --beam-size 4 --alpha 0.6
    python - "$(pick $split.en)" "$RUN/$split.hyp" "$split" <<'EOF'
import sys

import sacrebleu

sys.path.insert(0, ".")
from pipeline.textio import read_lines

ref, hyp, split = read_lines(sys.argv[1]), read_lines(sys.argv[2]), sys.argv[3]
bleu, chrf = sacrebleu.BLEU(), sacrebleu.CHRF()
print(f"{split}: BLEU {bleu.corpus_score(hyp, [ref]).score:.2f} ({bleu.get_signature()}), "
      f"chrF {chrf.corpus_score(hyp, [ref]).score:.2f}")
EOF
done
