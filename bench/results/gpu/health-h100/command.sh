set -uo pipefail
export PYTHONUNBUFFERED=1
py=/opt/torch/.venv/bin/python3; repo=$PWD; W=/tmp/w; mkdir -p $W
$py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
OUT=$W bash bench/gpu_capture.sh > $W/capture.txt 2>&1; echo "capture rc=$?"; tail -5 $W/capture.txt
nvidia-smi nvlink -s > $W/nvlink.txt 2>&1
{ for i in 1 2 3 4 5; do s=$EPOCHREALTIME; PYTHONPATH=$repo/node $py -m dscnode gpu-health --gpus '[0]' > /tmp/gh.json; e=$EPOCHREALTIME; echo "gate $i: $(awk "BEGIN{print $e-$s}") s"; done; cat /tmp/gh.json; } > $W/gate.txt 2>&1
cat $W/gate.txt | head -8
mkdir -p /tmp/ar && (cd /tmp/ar && DSC_RUN_DIR=/tmp/ar PYTHONPATH=$repo/node:$repo:/tmp/site timeout 180 $py -m torch.distributed.run --nproc_per_node 1 -m train.allreduce --sizes 1,64 > $W/allreduce-log.txt 2>&1; echo "allreduce rc=$?"; cp /tmp/ar/allreduce.json $W/ 2>/dev/null; ls /tmp/ar)
GPUS=1 OUT=$W/r timeout 420 bash bench/gpu_ranks.sh .whl zero3 2 30 > $W/ranks-out.txt 2>&1; echo "ranks rc=$?"; tail -8 $W/ranks-out.txt
(cd $W/r && tar czf /tmp/ranks.tgz . && rm -rf $W/r && mv /tmp/ranks.tgz $W/)
for d in /tmp/runs/*; do echo "== $d"; ls $d/nccl_debug 2>&1 | head; PYTHONPATH=$repo/node $py -c "import json,sys; from dscnode.records import status; st=status(sys.argv[1], 'x'); print(json.dumps(st['nccl']))" $d; done > $W/status-nccl.txt 2>&1; head -20 $W/status-nccl.txt
d=$(ls -d /tmp/runs/* | head -1); tar czf $W/nccl-run.tgz -C $d nccl_debug 2>/dev/null
ls -la $W; tar czf $OUT/all.tgz -C $W .
