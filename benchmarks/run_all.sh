#!/usr/bin/env bash
# Runs every benchmark one after another (never two trainings at once) and keeps their logs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1
mkdir -p benchmarks/results
for b in throughput overhead memory precision paper004; do
  echo "== $b"
  $PY benchmarks/$b.py 2>&1 | grep -v -i -E "warn|Loading weights" | tee benchmarks/results/$b.log
done
echo "== paper 004's vision half: a ViT pretrained on MNIST 0-4 learns 5-9 federated (3 seeds)"
$PY benchmarks/mnist_vit.py prepare 2>&1 | grep -v -i -E "warn|Loading weights|Writing model" \
  | tee benchmarks/results/mnist_vit_prepare.log
$PY benchmarks/mnist_vit.py run --seeds 0,1,2 2>&1 | grep -v -i -E "warn|Loading weights|Writing model" \
  | tee benchmarks/results/mnist_vit.log
# local training times with nothing else running, and the clients trained one at a time against 10 per pass
$PY benchmarks/mnist_vit.py run --seeds 0,1 --partitions iid --runs runs/mnist_vit/timing \
  --out benchmarks/results/mnist_vit_timing.json 2>&1 | grep -v -i -E "warn|Loading weights|Writing model" \
  | tee benchmarks/results/mnist_vit_timing.log
for pp in 1 10; do
  $PY benchmarks/mnist_vit.py run --seeds 0 --methods houlsby,lora --partitions iid --set runtime.clients_per_pass=$pp \
    --runs runs/mnist_vit/per_pass$pp --out benchmarks/results/mnist_vit_per_pass$pp.json 2>&1 \
    | grep -v -i -E "warn|Loading weights|Writing model" | tee -a benchmarks/results/mnist_vit_per_pass.log
done
echo "== clients per pass"
$PY benchmarks/clients_per_pass.py --scenario cross-device cross-silo-minilm --out benchmarks/results/clients_per_pass.json \
  2>&1 | grep -v -i -E "warn|Loading weights" | tee benchmarks/results/clients_per_pass.log
# how far fused passes are from one client at a time (docs/guide/clients-per-pass.md, "Same results")
$PY benchmarks/fused_exactness.py --out benchmarks/results/fused_exactness.json 2>&1 \
  | grep -v -i -E "warn|Loading weights" | tee benchmarks/results/fused_exactness.log
# worker processes (docs/benchmarks/workers.md, its current figures): about two hours on 2 cores
W=benchmarks/results/clients_per_pass_workers_mmap
$PY benchmarks/clients_per_pass.py --scenario cross-silo-minilm --per-pass 1 w2 w2x2 flower --repeats 3 --out $W.json 2>&1 \
  | grep -v -i -E "warn|Loading weights" | tee $W.log
$PY benchmarks/clients_per_pass.py --scenario cross-silo-smollm2 --per-pass 1 w2 --out $W.json 2>&1 \
  | grep -v -i -E "warn|Loading weights" | tee -a $W.log
$PY benchmarks/clients_per_pass.py --scenario cross-device --per-pass 32 w2x16 wautoxauto --no-flower --out $W.json \
  2>&1 | grep -v -i -E "warn|Loading weights" | tee -a $W.log
S=benchmarks/results/clients_per_pass_workers_smollm2  # (its page's second SmolLM2-135M run)
$PY benchmarks/clients_per_pass.py --scenario cross-silo-smollm2 --per-pass 1 w2 w2x2 --out $S.json 2>&1 \
  | grep -v -i -E "warn|Loading weights" | tee $S.log
$PY benchmarks/clients_per_pass.py --scenario cross-silo-smollm2 --per-pass w2x2 --no-flower --no-limit \
  --set runtime.max_pass_tokens=512 --out ${S}_512.json 2>&1 | grep -v -i -E "warn|Loading weights" | tee -a $S.log
# Paper 000: each experiment reuses the runs the earlier ones trained (runs/paper000/)
for e in table1 fig4 table5 fig5 table3; do
  echo "== paper000 $e"
  $PY benchmarks/paper000.py $e 2>&1 | grep -v -i -E "warn|Loading weights" | tee benchmarks/results/paper000_$e.log
done
echo "== paper000 selection (100 rounds)"
$PY benchmarks/paper000.py selection --rounds 100 --eval-every 10 --runs runs/paper000_r100 2>&1 \
  | grep -v -i -E "warn|Loading weights" | tee benchmarks/results/paper000_selection.log
echo "== head pruning's gap on four 20 Newsgroups groups (3 seeds)"
$PY benchmarks/headprune_gap.py prepare
$PY benchmarks/headprune_gap.py run --seeds 0,1,2 2>&1 | grep -v -i -E "warn|Loading weights" \
  | tee benchmarks/results/headprune_gap.log
echo "== starting learning rates: a short sweep per PEFT method and algorithm"
# everything but FedSP (its own results file: SmolLM2 runs, minutes each)
$PY benchmarks/lr_sweep.py --only full,lora,houlsby,pfeiffer,ia3,bitfit,prompt_tuning,p_tuning,prefix_tuning,fedprox,\
fedavgm,fedadam,fedyogi,ffa_lora,fedsa_lora,flora,fedex_lora,hetlora,flexlora,headprune,fedpeptao \
  2>&1 | grep -v -i -E "warn|Loading weights|Writing model" | tee benchmarks/results/lr_sweep.log
$PY benchmarks/lr_sweep.py --only fedsp --out benchmarks/results/lr_sweep_fedsp.json 2>&1 \
  | grep -v -i -E "warn|Loading weights|Writing model" | tee benchmarks/results/lr_sweep_fedsp.log
# seeds 1 and 2 where one seed's 100 questions cannot tell the rates apart (adds to the results file)
$PY benchmarks/lr_sweep.py --only fedsp --rates 1e-2,3e-2,1e-1 --seeds 1,2 --out benchmarks/results/lr_sweep_fedsp.json \
  2>&1 | grep -v -i -E "warn|Loading weights|Writing model" | tee -a benchmarks/results/lr_sweep_fedsp.log
echo "== federated LoRA methods (3 seeds)"
$PY benchmarks/lora_methods.py --seeds 0,1,2 2>&1 | grep -v -i -E "warn|Loading weights" \
  | tee benchmarks/results/lora_methods.log
echo "== Byzantine-robust aggregation under simulated attacks"
$PY benchmarks/robust_aggregation.py --out benchmarks/results/robust_aggregation.json 2>&1 \
  | grep -v -i -E "warn|Loading weights" | tee benchmarks/results/robust_aggregation.log
# seeds 1 and 2 for the clean runs and three of the 30% attacks (the invocation adds to the results file)
$PY benchmarks/robust_aggregation.py --seeds 1,2 --fractions 0.3 --attacks scale,sign_flip,label_flip 2>&1 \
  | grep -v -i -E "warn|Loading weights" | tee benchmarks/results/robust_aggregation_seeds.log
$PY benchmarks/robust_diagnostics.py 2>&1 | grep -v -i -E "warn|Loading weights|Failed to load" > benchmarks/results/robust_diagnostics.log
# simulated time: FedBuff at 1,000 and 10,000 clients; FedBuff against synchronous FedAvg on 1,000 phones
$PY benchmarks/async_time.py scale 2>&1 | grep -v -i -E "warn|Loading weights" | tee benchmarks/results/async_scale.log
$PY benchmarks/async_time.py fedbuff 2>&1 | grep -v -i -E "warn|Loading weights" | tee benchmarks/results/async_fedbuff.log
$PY benchmarks/async_time.py fedbuff --only FedBuff --seeds 0 --steps 60 --out benchmarks/results/async_fedbuff_60.json 2>&1 \
  | grep -v -i -E "warn|Loading weights" | tee benchmarks/results/async_fedbuff_60.log
$PY benchmarks/async_time.py fedbuff --only FedBuff --seeds 1,2 --steps 60 --out benchmarks/results/async_fedbuff_60_s12.json \
  2>&1 | grep -v -i -E "warn|Loading weights" | tee benchmarks/results/async_fedbuff_60_s12.log
# attention's share of the counted FLOPs (the CPU's fused kernel, which torch's own counter counts as 0)
$PY benchmarks/mnist_vit.py prepare --max-steps 1 --work runs/attention_flops_vit 2>&1 | grep -v -i -E "warn|Writing model"
$PY benchmarks/attention_flops.py --vit-work runs/attention_flops_vit --out benchmarks/results/attention_flops.json 2>&1 \
  | grep -v -i -E "warn|Loading weights|Writing model" | tee benchmarks/results/attention_flops.log
# the papers in simulated time: paper 004 (ViT; after mnist_vit.py prepare above) and paper 000 on phones and data-centre links
$PY benchmarks/papers_time.py paper004 --data vit 2>&1 | grep -v -i -E "warn|Loading weights" | tee benchmarks/results/papers_time_paper004_vit.log
for s in 1 2; do
  $PY benchmarks/papers_time.py paper004 --data vit --set seed=$s --runs runs/papers_time_s$s \
    --out benchmarks/results/papers_time_paper004_vit_s$s.json 2>&1 | grep -v -i -E "warn|Loading weights" \
    | tee benchmarks/results/papers_time_paper004_vit_s$s.log
done
$PY benchmarks/papers_time.py paper004 --data text 2>&1 | grep -v -i -E "warn|Loading weights|Writing model shards" \
  | tee benchmarks/results/papers_time_paper004_text.log
$PY benchmarks/papers_time.py paper000 --arms fedavg-random,method-loss 2>&1 | grep -v -i -E "warn|Loading weights" \
  | tee benchmarks/results/papers_time_paper000.log
