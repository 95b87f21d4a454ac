#!/usr/bin/env bash
# One GPU call of the HARTS sweep (see docs/gpu-runbook.md). Usage on the device machine:
#   bash scripts/gpu_sweep.sh warm|retest|grpo|adamw|pack2|kernels|model|compact|compactfid|fidelity|speedup|train1[h|b|f|p]|train2[h|b]|sp1p|normgpu|speedup2|cp|cpgap|gradgap|gradgapt|layouts2|layouts2b|tpfix|gdump|tpdiag|kdah8|ref1n|layouts9|dist211|layouts8|fid1 [...]
# (train1b/train2b: the baseline run, then the comparison if the HARTS run of this call exists)
# with carry [".whl", ".triton_cache.tar.xz"]. Every step has its own timeout and tees its log into $OUT/sweep.log
# (at most 8 files come back per call: keep to 2-3 steps per call); the Triton cache (compiled kernels +
# autotune results, fla caches them on disk) comes back as xz pieces;
# here, `cat $files_at/triton_cache.tar.xz.* > .triton_cache.tar.xz` before the next call.
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT" .triton_cache
# The cache travels packed (carry is capped at 64 MiB; unpacked it is several times that).
[ -f .triton_cache.tar.xz ] && tar -C .triton_cache -xJf .triton_cache.tar.xz
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed" >&2; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton_cache TRITON_CACHE_AUTOTUNING=1
export PYTORCH_ALLOC_CONF=expandable_segments:True
# (at most 8 files come back: the machine facts go into the log, not a file of their own)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$OUT/sweep.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/sweep.log"

# The whole call must leave time to pack the cache: SWEEP_BUDGET (s, default 540) caps every step.
SWEEP_END=$(( $(date +%s) + ${SWEEP_BUDGET:-540} - 30 ))
touch /tmp/.sweep_start
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local left=$(( SWEEP_END - $(date +%s) ))
  (( left < secs )) && secs=$left
  (( secs < 10 )) && { echo "== $name skipped (no time left)" | tee -a "$OUT/sweep.log"; return; }
  echo "== $name ($(date +%T), limit ${secs}s)" | tee -a "$OUT/sweep.log"
  timeout "$secs" "$@" 2>&1 | tee -a "$OUT/sweep.log"
  echo "== $name rc=${PIPESTATUS[0]} ($(date +%T))" | tee -a "$OUT/sweep.log"
}

# cp = 1 on the cp2 config's step (same data section and seed; session 6's first comparison ran the 1-GPU
# config's seed by mistake, a different step)
CP1="--config configs/ling3_tiny_2gpu_cp2.toml --parallelism.context_parallel_degree=1 --parallelism.expert_parallel_degree=1 --harts.capacity=65536"
for what in "$@"; do
  case $what in
    # every GPU test; the ones that failed or have not passed on a GPU yet first (session 3, call 2: attention,
    # conv, ops-KDA and logprobs passed)
    warm) step warm 300 python3 -m pytest -m gpu -v -s -p no:cacheprovider --durations=0 tests/test_ops_norm.py tests/test_ops_moe.py \
            tests/test_model_ling.py tests/test_kernels_kda_round.py tests/test_runtime_gpu.py tests/test_ops_attention.py \
            tests/test_ops_conv.py tests/test_ops_kda.py tests/test_kernels_logprobs.py ;;
    # what changed since session 3's GPU calls: fused norms, MoE combine + gradient checks, the model test
    # bound, KDA-round host caching (the KDA-round tests last: they passed in session 3 and take ~95 s)
    retest) step retest 240 python3 -m pytest -m gpu -v -s -p no:cacheprovider --durations=0 tests/test_ops_norm.py \
            tests/test_ops_moe.py tests/test_model_ling.py tests/test_runtime_gpu.py tests/test_kernels_kda_round.py ;;
    # session 4's one-GPU gap (HARTS vs baseline grad norm 13 % apart at step 1): the small-scale GRPO
    # gradient check, and the baseline's step-1 grad norm under a second packing (2 trajectories per
    # microbatch instead of 1; compare with train1_base's step 1)
    grpo) step grpo 150 python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/test_runtime_gpu.py \
            tests/test_bf16_adamw.py -k "grpo_gradient or cuda" ;;
    adamw) step adamw 60 python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/test_bf16_adamw.py ;;
    pack2) step pack2 200 python3 train.py --config configs/ling3_tiny_1gpu.toml --training.steps=1 \
              --harts.enabled=false --harts.capacity=131072 --profile.enable=false --job.dump_folder=/tmp/pack2 ;;
    kernels) step kernels 200 python3 -m harts.bench.kernels --out "$OUT" --trace /tmp/kda_traces ;;
    model) step model 240 python3 -m harts.bench.model --out "$OUT" ;;
    compact) step compact 420 python3 -m harts.bench.compact --preset ling3-tiny --scale 0.05 --capacity 65536 \
            --repeats 1 --truth float32 --out "$OUT" ;;
    compactfid) step compactfid 300 python3 -m harts.bench.compact --preset ling3-tiny --scale 0.05 --capacity 65536 \
            --no-timing --truth float32 --out "$OUT" ;;
    fidelity) step fidelity 240 python3 -m harts.bench.fidelity --preset ling3-tiny --scale 0.05 --out "$OUT" ;;
    # issue 9: the 16 fullest microbatches (the acceptance); ~24 s each (HARTS ~5 s + baseline ~19 s at
    # 300K raw rows), so give it a call of its own (SWEEP_BUDGET=590); timing stops starting new ones after
    # 400 s so the profile and the JSON still fit (the report says how many were timed)
    speedup) step speedup 565 python3 -m harts.bench.speedup --preset ling3-tiny --scale 0.2 --microbatches 16 \
            --time-budget 400 --out "$OUT" ;;
    train1|train1h) step train1_harts 330 python3 train.py --config configs/ling3_tiny_1gpu.toml --training.steps=20 \
              --job.dump_folder=/tmp/train1_harts ;;&
    train1|train1b) step train1_base 540 python3 train.py --config configs/ling3_tiny_1gpu.toml --training.steps=20 \
              --harts.enabled=false --job.dump_folder=/tmp/train1_base ;;&
    train1|train1b) [ -f /tmp/train1_harts/metrics.jsonl ] && step train1_cmp 30 python3 -m harts.bench.train_speedup \
              --harts /tmp/train1_harts/metrics.jsonl --baseline /tmp/train1_base/metrics.jsonl --out "$OUT/train1" \
              --config configs/ling3_tiny_1gpu.toml ;;
    train1h) ;;
    # issue 8's control: the baseline repacked (two trajectories per microbatch at capacity 131072), 20 steps.
    # Its curve against train1_base is the execution-shape floor on this random-init model (session 3: top-k
    # flips make the baseline disagree with itself more than with HARTS); the step's new shapes compile first.
    train1p) step train1_pack2 540 python3 train.py --config configs/ling3_tiny_1gpu.toml --training.steps=20 \
              --harts.enabled=false --harts.capacity=131072 --job.dump_folder=/tmp/train1_pack2 ;;
    # on nvidia-h200-x2: issue 9's speedup (GPU 0) next to issue 8's train1p control (GPU 1), one call for both
    # (separate GPUs; the speedup is a ratio of two paths timed in the same process)
    sp1p) CUDA_VISIBLE_DEVICES=1 step train1_pack2 540 python3 train.py --config configs/ling3_tiny_1gpu.toml \
              --training.steps=20 --harts.enabled=false --harts.capacity=131072 --job.dump_folder=/tmp/train1_pack2 &
        CUDA_VISIBLE_DEVICES=0 step speedup 565 python3 -m harts.bench.speedup --preset ling3-tiny --scale 0.2 \
              --microbatches 16 --time-budget 400 --out "$OUT"
        wait ;;
    # the norm launchers' GPU tests (compiled kernels vs torch; no recompile inside an NB/BS size class)
    normgpu) step normgpu 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ops_norm.py ;;
    # on nvidia-h200-x2: issue 9's speedup with its 16 microbatches split over the two GPUs (microbatches
    # 0, 2, ... on GPU 0, which also profiles; 1, 3, ... on GPU 1; merged here), then (SPEEDUP2_FIDELITY=1) the
    # fidelity bench on GPU 1.
    # Each microbatch is timed by one process on one H200, as on one GPU; a run that loaded Triton kernels is
    # timed again (session 7's first run: three of six microbatches ran 2.2-4.9x slower per raw row than the
    # others while the Triton cache grew)
    speedup2) ( CUDA_VISIBLE_DEVICES=1 step speedup_1 540 python3 -m harts.bench.speedup --preset ling3-tiny \
              --scale 0.2 --microbatches 16 --shard 1/2 --time-budget ${SPEEDUP_BUDGET:-470} --out "$OUT"
          [ -n "${SPEEDUP2_FIDELITY:-}" ] && CUDA_VISIBLE_DEVICES=1 step fidelity 240 python3 -m harts.bench.fidelity \
              --preset ling3-tiny --scale 0.05 --out "$OUT" ) &
        CUDA_VISIBLE_DEVICES=0 step speedup_0 540 python3 -m harts.bench.speedup --preset ling3-tiny --scale 0.2 \
              --microbatches 16 --shard 0/2 --time-budget ${SPEEDUP_BUDGET:-470} --out "$OUT"
        wait ;;  # here: python -m harts.bench.speedup --merge DIR/speedup_shard0of2.json DIR/speedup_shard1of2.json
    # the fused BF16AdamW update (optimizer.bf16_fused): step minus F/B/Grad against train1h's 0.43 s
    train1f) step train1_fused 200 python3 train.py --config configs/ling3_tiny_1gpu.toml --training.steps=8 \
              --optimizer.bf16_fused=true --profile.enable=false --job.dump_folder=/tmp/train1_fused ;;
    train2|train2h) step train2_harts 330 torchrun --nproc_per_node 2 train.py --config configs/ling3_tiny_2gpu.toml \
              --training.steps=20 --job.dump_folder=/tmp/train2_harts ;;&
    train2|train2b) step train2_base 540 torchrun --nproc_per_node 2 train.py --config configs/ling3_tiny_2gpu.toml \
              --training.steps=20 --harts.enabled=false --job.dump_folder=/tmp/train2_base ;;&
    train2|train2b) [ -f /tmp/train2_harts/metrics.jsonl ] && step train2_cmp 30 python3 -m harts.bench.train_speedup \
              --harts /tmp/train2_harts/metrics.jsonl --baseline /tmp/train2_base/metrics.jsonl --out "$OUT/train2" \
              --config configs/ling3_tiny_2gpu.toml ;;
    train2h) ;;
    # CP_STEPS (default 6) steps each, the third profiled
    cp) step cp2 ${CP2_LIMIT:-300} torchrun --nproc_per_node 2 train.py --config configs/ling3_tiny_2gpu_cp2.toml \
              --training.steps=${CP_STEPS:-6} --profile.steps=3 --job.dump_folder=/tmp/cp2 ;;&
    # issue 11's comparison on one GPU: the cp2 config's own step at cp = 1 (capacity 65536), then at cp2's
    # capacity 131072 (one microbatch as large as cp2's; expected not to fit)
    cp|cp1) step cp1 240 python3 train.py $CP1 --training.steps=${CP_STEPS:-4} --profile.steps=3 --job.dump_folder=/tmp/cp1
         PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step cp1_big 150 python3 train.py $CP1 --harts.capacity=131072 \
              --training.steps=2 --profile.enable=false --job.dump_folder=/tmp/cp1_big ;;
    # issue 8's open question: which bf16 gradient (HARTS, baseline) is nearer the fp32 one, part by part
    gradgapt) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step gradgap_truth 450 python3 -m harts.bench.gradgap --config configs/ling3_tiny_1gpu.toml --truth \
              --out "$OUT" ;;
    gradgap) step gradgap 240 python3 -m harts.bench.gradgap --config configs/ling3_tiny_1gpu.toml --out "$OUT" ;;
    # on nvidia-h200-x2: cp2 on both GPUs, then cp1 (GPU 0) next to the fp32-truth gradgap of the whole loss
    # (GPU 1, session 6: the truth's first run took 373 s, mostly compiling fp32 kernels and MoE copies)
    cpgapt) step cp2 ${CP2_LIMIT:-260} torchrun --nproc_per_node 2 train.py --config configs/ling3_tiny_2gpu_cp2.toml \
              --training.steps=${CP_STEPS:-4} --profile.steps=3 --job.dump_folder=/tmp/cp2
        CUDA_VISIBLE_DEVICES=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step gradgap_truth 300 python3 -m \
              harts.bench.gradgap --config configs/ling3_tiny_1gpu.toml --truth --parts all --out "$OUT" &
        CUDA_VISIBLE_DEVICES=0 step cp1 240 python3 train.py $CP1 --training.steps=${CP_STEPS:-4} --profile.steps=3 \
              --job.dump_folder=/tmp/cp1
        wait ;;
    # on nvidia-h200-x2: cp2 on both GPUs, then cp1 (GPU 0) next to gradgap (GPU 1); their log lines interleave
    cpgap) step cp2 240 torchrun --nproc_per_node 2 train.py --config configs/ling3_tiny_2gpu_cp2.toml --training.steps=6 \
              --job.dump_folder=/tmp/cp2
        CUDA_VISIBLE_DEVICES=1 step gradgap 240 python3 -m harts.bench.gradgap --config configs/ling3_tiny_1gpu.toml \
              --out "$OUT" &
        CUDA_VISIBLE_DEVICES=0 step cp1 240 python3 train.py $CP1 --training.steps=6 --job.dump_folder=/tmp/cp1
        wait ;;
    layouts2)  # issue 10 at reduced degree on 2 GPUs: the 8-GPU layouts' TP2+SP+EP and PP2 parts, pure bf16
      R2="--data.scale=0.01 --data.fixed_step=true --training.steps=4 --ling.dtype=bfloat16 --optimizer.implementation=foreach --checkpoint.enable=false"
      step tp2_sp_ep2 200 torchrun --nproc_per_node 2 train.py --config configs/ling3_tiny_8gpu_dp4_tp2_ep8.toml $R2 \
        --parallelism.data_parallel_shard_degree=1 --parallelism.expert_parallel_degree=2 --job.dump_folder=/tmp/tp2_sp_ep2
      step pp2 200 torchrun --nproc_per_node 2 train.py --config configs/ling3_tiny_8gpu_dp2_pp4_ep2.toml $R2 \
        --parallelism.data_parallel_shard_degree=1 --parallelism.pipeline_parallel_degree=2 \
        --parallelism.expert_parallel_degree=1 --job.dump_folder=/tmp/pp2 ;;
    # the same 4 steps on one GPU (both configs differ only in their degrees: one reference for both), then each
    # reduced layout's trajectory-wise baseline: HARTS's speedup per layout and its distance from one GPU
    layouts2b) R2="--data.scale=0.01 --data.fixed_step=true --training.steps=4 --ling.dtype=bfloat16 --optimizer.implementation=foreach --checkpoint.enable=false"
      L1="--parallelism.data_parallel_shard_degree=1 --parallelism.tensor_parallel_degree=1 --parallelism.expert_parallel_degree=1"
      ( CUDA_VISIBLE_DEVICES=1 step ref1_base 240 python3 train.py --config configs/ling3_tiny_8gpu_dp4_tp2_ep8.toml $R2 $L1 \
          --harts.enabled=false --job.dump_folder=/tmp/ref1_base ) &
      CUDA_VISIBLE_DEVICES=0 step ref1 150 python3 train.py --config configs/ling3_tiny_8gpu_dp4_tp2_ep8.toml $R2 $L1 \
          --job.dump_folder=/tmp/ref1
      wait
      step tp2_sp_ep2_base 200 torchrun --nproc_per_node 2 train.py --config configs/ling3_tiny_8gpu_dp4_tp2_ep8.toml $R2 \
        --parallelism.data_parallel_shard_degree=1 --parallelism.expert_parallel_degree=2 --harts.enabled=false \
        --job.dump_folder=/tmp/tp2_sp_ep2_base
      step pp2_base 200 torchrun --nproc_per_node 2 train.py --config configs/ling3_tiny_8gpu_dp2_pp4_ep2.toml $R2 \
        --parallelism.data_parallel_shard_degree=1 --parallelism.pipeline_parallel_degree=2 \
        --parallelism.expert_parallel_degree=1 --harts.enabled=false --job.dump_folder=/tmp/pp2_base ;;
    # session 8: TP2 + SP's baseline had a 43 % larger step-1 gradient norm than one GPU (ref1_base); after the
    # TP/SP boundaries wait on their collectives (harts.train.model.Completed): the same runs, then SP off and
    # FSDP2 + EP2 without TP, to place any remaining difference
    tpfix) R2="--data.scale=0.01 --data.fixed_step=true --training.steps=4 --ling.dtype=bfloat16 --optimizer.implementation=foreach --checkpoint.enable=false"
      T2="torchrun --nproc_per_node 2 train.py --config configs/ling3_tiny_8gpu_dp4_tp2_ep8.toml $R2 --parallelism.expert_parallel_degree=2"
      step tp2_sp_ep2_base 150 $T2 --parallelism.data_parallel_shard_degree=1 --harts.enabled=false --job.dump_folder=/tmp/tp2_sp_ep2_base
      step tp2_sp_ep2 90 $T2 --parallelism.data_parallel_shard_degree=1 --job.dump_folder=/tmp/tp2_sp_ep2
      step tp2_ep2_base 150 $T2 --parallelism.data_parallel_shard_degree=1 --parallelism.enable_sequence_parallel=false \
        --harts.enabled=false --job.dump_folder=/tmp/tp2_ep2_base
      step dp2_ep2_base 150 $T2 --parallelism.data_parallel_shard_degree=2 --parallelism.tensor_parallel_degree=1 \
        --parallelism.enable_sequence_parallel=false --harts.enabled=false --job.dump_folder=/tmp/dp2_ep2_base ;;
    # step 1's per-parameter gradient norms (HARTS_DUMP_GRAD_NORMS) of TP2 + EP2 and of one GPU, both modes;
    # compare here with the JSONs (which parameters carry TP2's excess gradient norm)
    gdump) G="--data.scale=0.01 --data.fixed_step=true --training.steps=1 --ling.dtype=bfloat16 --optimizer.implementation=foreach --checkpoint.enable=false"
      T2="torchrun --nproc_per_node 2 train.py --config configs/ling3_tiny_8gpu_dp4_tp2_ep8.toml $G --parallelism.expert_parallel_degree=2 --parallelism.data_parallel_shard_degree=1 --parallelism.enable_sequence_parallel=false"
      L1="python3 train.py --config configs/ling3_tiny_8gpu_dp4_tp2_ep8.toml $G --parallelism.data_parallel_shard_degree=1 --parallelism.tensor_parallel_degree=1 --parallelism.expert_parallel_degree=1"
      HARTS_DUMP_GRAD_NORMS=$OUT/gn_tp2_base step gn_tp2_base 90 $T2 --harts.enabled=false --job.dump_folder=/tmp/gn1
      HARTS_DUMP_GRAD_NORMS=$OUT/gn_tp2_harts step gn_tp2_harts 70 $T2 --job.dump_folder=/tmp/gn2
      ( CUDA_VISIBLE_DEVICES=1 HARTS_DUMP_GRAD_NORMS=$OUT/gn_ref_harts step gn_ref_harts 80 $L1 --job.dump_folder=/tmp/gn3 ) &
      CUDA_VISIBLE_DEVICES=0 HARTS_DUMP_GRAD_NORMS=$OUT/gn_ref_base step gn_ref_base 90 $L1 --harts.enabled=false --job.dump_folder=/tmp/gn4
      wait ;;
    # which fast path carries TP2's excess gradient norm (one step each; compare step-1 gnorm with one GPU's
    # 7.741). On CPU (gloo, session 8) TP2 equals one process with the fused norms, fla's KDA and conv (Triton
    # interpreter, fp32), the fused log-probs, grouped_mm experts, bf16 + BF16AdamW and full AC: what is left
    # is CUDA-only (torch varlen attention, CUDA grouped_mm) or size-dependent. First the baseline at capacity
    # 131072 (3 microbatches instead of 5): session 8's per-parameter norms were a uniform 1.25x, as if one of
    # five microbatches' gradients were counted twice
    tpdiag) G="--data.scale=0.01 --data.fixed_step=true --training.steps=1 --ling.dtype=bfloat16 --optimizer.implementation=foreach --checkpoint.enable=false --harts.enabled=false"
      T2="torchrun --nproc_per_node 2 train.py --config configs/ling3_tiny_8gpu_dp4_tp2_ep8.toml $G --parallelism.data_parallel_shard_degree=1 --parallelism.enable_sequence_parallel=false"
      HARTS_DUMP_GRAD_NORMS=$OUT/gn_cap131k step tp2_cap131k 90 $T2 --parallelism.expert_parallel_degree=2 --harts.capacity=131072 --job.dump_folder=/tmp/d0
      HARTS_DUMP_GRAD_NORMS=$OUT/gn_attn_ref step tp2_attn_ref 120 $T2 --parallelism.expert_parallel_degree=2 --ling.op_backends=attention=reference --job.dump_folder=/tmp/d1
      HARTS_DUMP_GRAD_NORMS=$OUT/gn_moe_ref step tp2_moe_ref 100 $T2 --parallelism.expert_parallel_degree=2 --ling.op_backends=moe=reference --job.dump_folder=/tmp/d2
      HARTS_DUMP_GRAD_NORMS=$OUT/gn_ep1 step tp2_ep1 80 $T2 --parallelism.expert_parallel_degree=1 --job.dump_folder=/tmp/d3 ;;
    # session 9: the one-GPU references of the reduced layouts after the init fix (every tensor from its own
    # generator: layouts now start from one GPU's weights), 4 steps each with step-1 gradient-norm dumps
    ref1n) R2="--data.scale=0.01 --data.fixed_step=true --training.steps=4 --ling.dtype=bfloat16 --optimizer.implementation=foreach --checkpoint.enable=false"
      L1="python3 train.py --config configs/ling3_tiny_8gpu_dp4_tp2_ep8.toml $R2 --parallelism.data_parallel_shard_degree=1 --parallelism.tensor_parallel_degree=1 --parallelism.expert_parallel_degree=1"
      HARTS_DUMP_GRAD_NORMS=$OUT/gn_ref_harts step ref1 150 $L1 --job.dump_folder=/tmp/ref1
      HARTS_DUMP_GRAD_NORMS=$OUT/gn_ref_base step ref1_base 240 $L1 --harts.enabled=false --job.dump_folder=/tmp/ref1_base ;;
    # Table 5's row for one GPU (the layouts' reference): step 1's logit fidelity of HARTS and of a baseline
    # rerun against the baseline, on the layouts' step (harts.bench.layout_fidelity; positions strided by 4)
    fid1) F1="--data.scale=${FID1_SCALE:-0.01} --data.fixed_step=true --training.steps=1 --ling.dtype=bfloat16 --optimizer.implementation=foreach --checkpoint.enable=false"
      L1="python3 train.py --config configs/ling3_tiny_8gpu_dp4_tp2_ep8.toml $F1 --parallelism.data_parallel_shard_degree=1 --parallelism.tensor_parallel_degree=1 --parallelism.expert_parallel_degree=1"
      export HARTS_DUMP_HIDDEN_STRIDE=${FID1_STRIDE:-4}
      HARTS_DUMP_HIDDEN=/tmp/hd1_harts step fid1_harts 120 $L1 --job.dump_folder=/tmp/fid1_harts
      HARTS_DUMP_HIDDEN=/tmp/hd1_base step fid1_base 200 $L1 --harts.enabled=false --job.dump_folder=/tmp/fid1_base
      [ -n "${FID1_NO_RERUN:-}" ] || HARTS_DUMP_HIDDEN=/tmp/hd1_base2 step fid1_base2 120 $L1 --harts.enabled=false --job.dump_folder=/tmp/fid1_base2
      step fid1_cmp 60 python3 -m harts.bench.layout_fidelity /tmp/hd1_base /tmp/hd1_harts --out $OUT/fid1_harts
      step fid1_rerun 60 python3 -m harts.bench.layout_fidelity /tmp/hd1_base /tmp/hd1_base2 --out $OUT/fid1_rerun ;;
    # session 9, two GPUs: TP2 + SP + EP2 and PP2 (pipeline filled), both modes, step-1 gradient-norm dumps;
    # compare with ref1n's (scripts/compare_grad_norms.py)
    layouts9) R2="--data.scale=0.01 --data.fixed_step=true --training.steps=4 --ling.dtype=bfloat16 --optimizer.implementation=foreach --checkpoint.enable=false"
      T2="torchrun --nproc_per_node 2 train.py --config configs/ling3_tiny_8gpu_dp4_tp2_ep8.toml $R2 --parallelism.data_parallel_shard_degree=1 --parallelism.expert_parallel_degree=2"
      P2="torchrun --nproc_per_node 2 train.py --config configs/ling3_tiny_8gpu_dp2_pp4_ep2.toml $R2 --parallelism.data_parallel_shard_degree=1 --parallelism.pipeline_parallel_degree=2 --parallelism.expert_parallel_degree=1"
      export HARTS_DUMP_HIDDEN_STRIDE=4  # step 1's final hidden states at a quarter of the positions (fidelity)
      case " ${L9_PARTS:-tp2 pp2} " in *" tp2 "*) ;; *) T2="true";; esac  # L9_PARTS: the layouts to run
      case " ${L9_PARTS:-tp2 pp2} " in *" pp2 "*) ;; *) P2="true";; esac
      HARTS_DUMP_HIDDEN=/tmp/hd_tp2_harts HARTS_DUMP_GRAD_NORMS=$OUT/gn_tp2_harts step tp2_sp_ep2 100 $T2 --job.dump_folder=/tmp/tp2_sp_ep2
      HARTS_DUMP_HIDDEN=/tmp/hd_tp2_base HARTS_DUMP_GRAD_NORMS=$OUT/gn_tp2_base step tp2_sp_ep2_base 150 $T2 --harts.enabled=false --job.dump_folder=/tmp/tp2_sp_ep2_base
      step fid_tp2 60 python3 -m harts.bench.layout_fidelity /tmp/hd_tp2_base /tmp/hd_tp2_harts --out $OUT/fid_tp2
      HARTS_DUMP_HIDDEN=/tmp/hd_pp2_harts HARTS_DUMP_GRAD_NORMS=$OUT/gn_pp2_harts step pp2 120 $P2 --job.dump_folder=/tmp/pp2
      HARTS_DUMP_HIDDEN=/tmp/hd_pp2_base HARTS_DUMP_GRAD_NORMS=$OUT/gn_pp2_base step pp2_base 150 $P2 --harts.enabled=false --job.dump_folder=/tmp/pp2_base
      step fid_pp2 60 python3 -m harts.bench.layout_fidelity /tmp/hd_pp2_base /tmp/hd_pp2_harts --out $OUT/fid_pp2 ;;
    # issue 10 on nvidia-h200-x8 (never lent so far), one layout per call: L8=dp4_tp2_ep8 | dp2_pp4_ep2 |
    # dp2_tp2_pp2_ep4 (configs/ling3_tiny_8gpu_$L8.toml, full AC), both modes on the same fixed step, then the
    # trainer-level speedup (F/B/Grad, Core, compression, FLOP compression, MFU) and step 1's logit fidelity. L8_SCALE (default 0.25 of the
    # swe-step, so both modes fit one call) and L8_STEPS (4; step 1 skipped as warm-up) size it.
    layouts8) L8=${L8:?set L8 to a layout tag}; C8="configs/ling3_tiny_8gpu_$L8.toml"
      [ -f "$C8" ] || { echo "no config $C8" | tee -a "$OUT/sweep.log"; continue; }
      A8="--data.scale=${L8_SCALE:-0.25} --data.fixed_step=true --training.steps=${L8_STEPS:-4} --checkpoint.enable=false"
      export HARTS_DUMP_HIDDEN_STRIDE=${L8_STRIDE:-16}  # Table 5: step 1's final hidden states, 1/16 of the positions
      HARTS_DUMP_HIDDEN=/tmp/hd8_harts step l8_harts ${L8_LIMIT_H:-200} torchrun --nproc_per_node 8 train.py --config $C8 $A8 \
        --job.dump_folder=/tmp/l8_harts
      HARTS_DUMP_HIDDEN=/tmp/hd8_base step l8_base ${L8_LIMIT_B:-300} torchrun --nproc_per_node 8 train.py --config $C8 $A8 \
        --harts.enabled=false --job.dump_folder=/tmp/l8_base
      step l8_fidelity 90 python3 -m harts.bench.layout_fidelity /tmp/hd8_base /tmp/hd8_harts --out "$OUT/fid_$L8"
      for m in harts base; do [ -f /tmp/l8_$m/metrics.jsonl ] && cp /tmp/l8_$m/metrics.jsonl "$OUT/l8_${L8}_$m.metrics.jsonl"; done
      step l8_speedup 120 python3 -m harts.bench.train_speedup --skip 1 --harts /tmp/l8_harts/metrics.jsonl \
        --baseline /tmp/l8_base/metrics.jsonl --out "$OUT/train_speedup_$L8" --config $C8 $A8 ;;
    # the multi-process trainer tests on this image's torch (2.11), on its CPUs (gloo, float64): the
    # meta-device init's sharding (FSDP2 x TP strided shards included) on the GPU image's DTensor
    dist211) CUDA_VISIBLE_DEVICES= step dist211 ${DIST211_LIMIT:-420} python3 -m pytest -q -x -p no:cacheprovider \
        tests/test_train_distributed.py tests/test_model_ling.py -k "paper_8gpu or init" ;;
    # the KDA GPU tests at H = 8 (one rank's heads under TP2) with every gradient, A_log and dt_bias included
    kdah8) step kdah8 300 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_ops_kda.py \
              tests/test_kernels_kda_round.py -k "matches_reference_bf16 or bf16_vs_fp32_reference" ;;
    *) echo "unknown step $what" >&2 ;;
  esac
done
# Trainer runs: metrics.jsonl and a few-hundred-byte summary of the profiled step's trace come back.
for d in /tmp/train1_harts /tmp/train1_fused /tmp/train1_base /tmp/train2_harts /tmp/train2_base /tmp/cp2 /tmp/cp1 /tmp/tp2_sp_ep2 /tmp/pp2 /tmp/ref1 /tmp/ref1_base /tmp/tp2_sp_ep2_base /tmp/pp2_base /tmp/tp2_ep2_base /tmp/dp2_ep2_base /tmp/pack2 /tmp/cp1_big /tmp/train1_pack2; do
  # (only this call's runs: a machine can keep /tmp from an earlier call, session 7 got two stale runs back)
  [ "$d/metrics.jsonl" -nt /tmp/.sweep_start ] || continue
  n=$(basename $d)
  cp "$d/metrics.jsonl" "$OUT/$n.metrics.jsonl"
  t=$(ls "$d"/profile/step*/rank0_trace.json 2>/dev/null | head -1)
  [ -n "$t" ] && timeout 90 python3 -m harts.bench.trace_summary "$t" --json "$OUT/$n.profile.json" | tee -a "$OUT/sweep.log"
done
# At most 8 files come back per call and the cache takes 2-3 of them: every result file except the log
# travels in one results.tar (session 4 lost a comparison's JSON and PNG to the count); here:
# `tar -xf /work/.device/N/results.tar -C DIR`.
( cd "$OUT" && find . -type f ! -name 'triton_cache.tar.xz.*' ! -name sweep.log ! -name results.tar -print \
    | sort > /tmp/results.list && [ -s /tmp/results.list ] && tar -cf results.tar -T /tmp/results.list \
    && xargs -a /tmp/results.list rm -f && find . -mindepth 1 -type d -empty -delete ) \
  && echo "results.tar: $(wc -l < /tmp/results.list) files" | tee -a "$OUT/sweep.log"
# Only the binaries and metadata are read back on a cache hit (triton's get_group skips missing children,
# CompiledKernel keeps asm[binary_ext]); the IR files are ~80 % of the cache: drop them before packing.
find .triton_cache -type f \( -name '*.llir' -o -name '*.ttir' -o -name '*.ttgir' -o -name '*.source' \
  -o -name '*.ptx' \) -delete
# xz on all cores, in pieces under the 16 MiB a returned file may have.
tar -C .triton_cache -cf - . | xz -T0 -6 | split -b 15M -d - "$OUT/triton_cache.tar.xz." && ls -l "$OUT"/triton_cache.tar.xz.*
