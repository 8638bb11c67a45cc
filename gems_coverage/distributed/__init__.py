"""Distributed training with Gems on: DDP or FSDP2 through torch.distributed, launched by torchrun.

    torchrun --standalone --nproc-per-node 2 -m gems_coverage.distributed aquila --strategy fsdp2 \\
        --steps 50 --batch 8 --seq-len 2048 --dtype bf16 --gems both -o result.json

Scale-out is PyTorch's (docs/design.md, decision 11): this is a plain training script of the kind users run
(`init_process_group`, DDP or FSDP2 `fully_shard` per decoder layer then the root, AdamW with PyTorch's
defaults, gradient clipping), with Gems switched on by `gems.enable()` around the training steps.

What it does, per rank:

* **Model**: a built-in model (gems_models, random weights, dropout 0) built with the same seed on every
  rank; FSDP2 also broadcasts rank 0's weights before sharding (DDP does that itself). Parameters in
  `--dtype`; with `--mixed-precision` they stay fp32 and compute runs in `--dtype` (FSDP2:
  `MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)`; DDP: `torch.autocast`).
  `--checkpointing` recomputes each decoder layer in backward (Hugging Face's non-reentrant checkpointing).
* **Data**: synthetic tokens from a generator seeded per step (the same global batch on every rank,
  each rank takes its rows): Zipf-distributed tokens repeated with a random period, so the loss falls
  (uniform random tokens would keep it at ln(vocab) and make loss agreement meaningless). Or
  `--data FILE`: a saved integer tensor of token ids, cut into windows of `--seq-len`.
* **Step**: forward with labels (the tokens themselves: next-token loss for a causal LM, every position
  for a masked LM such as BERT), backward, the total gradient norm after reduction (DDP: of the
  all-reduced gradients; FSDP2: of the sharded gradients, reduced across ranks), clipping to `--clip`,
  `AdamW.step()` (foreach on CUDA, PyTorch's default).
* **`--gems both`**: the same seed and data twice in the same processes, ATen first (Gems never
  registered), then with `gems.enable()`; model and optimizer rebuilt in between. Per step: loss (mean
  over ranks), gradient norm; tokens/s after `--warmup` steps; peak memory per rank.
* **Verdict**: each step's loss by the end-to-end rule of `gems_coverage.parity` (relative error within
  `E2E_TOL` of the compute dtype; for bf16/fp16 with `--fp32-reference`, also passing when Gems' error
  against an fp32 ATen run is at most 2x ATen's own, `parity.lowp_rule`).
* **Ops around the collectives**: step 0 of the Gems run is traced on every rank (the tracer's
  `OpRecorder`), each ATen op tagged with where it was called from (model forward, backward, the
  DDP/FSDP2 wrapper's Python code, the optimizer, gradient clipping) and with what Gems did with it
  (served, fell back and why, not registered); the compute ops Gems did not serve are the gaps.
  Collectives (`c10d::*`) are listed separately: they stay NCCL's (gloo's).
* **Faults**: a Gems kernel that raises on one rank is answered by ATen on that rank (the dispatcher's
  fallback outside `GEMS_STRICT=1`; the fallbacks are reported per rank); nothing else changes, so the
  other ranks neither wait nor diverge (DDP averages gradients, FSDP2 reduce-scatters them: replicas
  stay consistent). With `GEMS_STRICT=1` the failing rank exits, and torchrun stops the others.
  When losses disagree, the Gems run's first `--shadow-steps` steps are run again under parity's
  shadow check on every rank (each Gems-served compute op re-run by ATen on copies of its inputs), which
  names the first diverging op per rank. `--inject-fault OP@RANK[:raise|wrong]` replaces one Gems
  implementation on one rank (a test aid: `raise` throws, `wrong` is a small silent numeric error).

Exit codes: 0 agreement (or a single mode run), 1 losses disagree, 2 bad input or launch (one line),
3 an error while running (one line per failing rank; GEMS_COVERAGE_DEBUG=1 shows the traceback).

The modules, in the order a run meets them: `options` (arguments, torchrun's environment, the plan), `data`,
`training` (model, optimizer, the steps), `step_trace` (where each op of step 0 came from), `verdict`
(loss agreement, per-op report, faults), `table`, and `launch` (the rank's `main`; `launch_main` behind
`gems-coverage distributed`).
"""
