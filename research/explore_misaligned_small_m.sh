# Every split_k tile 16 x {32, 64, 128} x {32, 64, 128} in splits 1..64 on small-M products whose rows are not
# 16-byte aligned, against cuBLAS (tools/time_candidates.py). LAYOUT=NN (default) or NT; SHAPES to override.
export PYTHONPATH=src PYTHONUNBUFFERED=1
for s in ${SHAPES:-5x423x2047 6x5661x26729 2x4385x1718 1x630x605 4x2939x268 8x134x11609}; do
  K=${s##*x}
  EXTRA=$(python3 -c "
import json
K=$K; out=[]
for bn in (32,64,128):
  for bk in (32,64,128):
    steps=-(-K//bk)
    for sp in (1,2,4,8,16,32,64):
      if sp<=steps: out.append([16,bn,bk,4,3,sp])
print(json.dumps({'split_k':out}))")
  timeout ${PER_SHAPE:-85} python3 tools/time_candidates.py $s --layout ${LAYOUT:-NN} --rungs split_k --rounds 1 --extra "$EXTRA" 2>&1 | head -8
done
