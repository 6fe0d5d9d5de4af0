export PYTHONPATH=src PYTHONUNBUFFERED=1
for s in 5x423x2047 6x5661x26729 2x4385x1718 1x630x605 4x2939x268 8x134x11609; do
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
  timeout 150 python3 tools/time_candidates.py $s --rungs split_k --rounds 1 --extra "$EXTRA" 2>&1 | head -14
done
