# Sweep "ep": expert parallelism, one table (bench/results/ep.md), each row compared with the baseline above it
# in the same round (harness --baseline). Same MoE model and global batch everywhere, 1 thread per rank:
#   - train_ep ep=2 (2 ranks) vs the single-device MoE (train_single.py --n_experts, 1 process);
#   - train_5d --dp 2 --ep 2 vs train_ep --ep 2 on the same 2 ranks: composition should cost nothing (>= 0.95);
#   - train_ep with the per-micro-batch load-balancing loss (--aux_loss_scope micro) vs the global-batch one
#     (the default): what global balancing costs. Its all-reduce of 2E+2 numbers per MoE block per step is the
#     one the router metrics need anyway, so the expected ratio is 1.
# The per-rank parameter bytes are counted (train_ep logs param_bytes; the formula is
# P_dense + MoE blocks * E/ep * (8h^2 + 5h)), not measured.
# Sourced by bench.sh (harness, STEPS, WARMUP, PYTHON are set there).
EP_RUN="OMP_NUM_THREADS=1 $PYTHON -m torch.distributed.run --standalone --nproc_per_node 2"
EP_COMMON="--max_steps $STEPS --warmup_steps 2 --eval_interval 0 --sample_tokens 0 --log_interval 1000 --device cpu --dtype float32 --out_dir {out}"
EP_MODEL="--n_layer 4 --n_head 4 --n_embd 256 --block_size 64 --n_experts 8 --top_k 2 --global_batch_size 16 --micro_batch_size 8"
EP_PARAMS=$($PYTHON -c "
from model import GPTConfig, num_params
c = GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=256, block_size=64, n_experts=8, top_k=2)
expert = 8 * 256 ** 2 + 5 * 256
full = num_params(c)
per_rank = full - 4 * (8 - 8 // 2) * expert
print(f'Parameters per rank (fp32, counted): single {full * 4 / 2**20:.1f} MiB, ep=2 {per_rank * 4 / 2**20:.1f} MiB '
      f'({per_rank / full:.2f}x: the experts, {4 * 8 * expert / full:.0%} of the model, are split in two).')
")

harness --name ep --title "Expert parallelism: train_ep and train_5d with ep, L4 H4 h256 T64 E8 top-2, B16, 1 thread per rank" \
  --note "$EP_PARAMS Same global batch of 16 sequences everywhere; at 2 ranks each runs 8 and exchanges tokens with all_to_all. Each row's ratios are to the baseline above it (the row showing 1.00), run in the same round." \
  --baseline "single MoE" \
  --run "single MoE=OMP_NUM_THREADS=1 $PYTHON train_single.py $EP_MODEL $EP_COMMON" \
  --run "train_ep ep 2=$EP_RUN train_ep.py --ep 2 $EP_MODEL $EP_COMMON" \
  --baseline "train_ep ep2" --target "5d dp2 ep2=0.95" \
  --run "train_ep ep2=$EP_RUN train_ep.py --ep 2 $EP_MODEL $EP_COMMON" \
  --run "5d dp2 ep2=$EP_RUN train_5d.py --dp 2 --ep 2 $EP_MODEL $EP_COMMON" \
  --run "train_ep ep2 micro aux=$EP_RUN train_ep.py --ep 2 --aux_loss_scope micro $EP_MODEL $EP_COMMON"
