"""FLOPs of one training micro-step (forward + backward of one sequence), counted GEMM by GEMM.

Every GEMM counts 2·M·N·K. Only GEMMs are counted: RMSNorm, RoPE, softmax, SiLU, the residual adds,
the cross-entropy and the embedding scatter are elementwise or reductions and are left out, so the
figure is the usual "model FLOPs" of the step's matrix products, not the machine's total work.

The counts follow what `Transformer.forward_backward` actually executes, kernel by kernel (§4.2–4.4):

- fwd_proj      q, k, v (sdpaFwd), o (woFwd), w1, w3, w2 (ffnFused): 2·S·in·out each.
- fwd_attn      scores q·kᵀ and probs·v per query head, 2·S·S·head_dim each. Causal attention still
                computes the full S×S product in these kernels (the mask is added afterwards), so
                it is counted in full. With GQA, K and V are repeated to every query head before
                the GEMMs, so the count uses `heads`, not `kv_heads`.
- classifier    logits = E·x, dx = Eᵀ·dlogits and dE += dlogits·xᵀ over the compact vocabulary:
                three GEMMs of n_active × dim × S (the dE one runs on the dW worker thread).
- bwd_dx        the input gradients through the seven projections (ffnBwdW2t, ffnBwdW13t, wotBwd,
                qBwd, kvBwd): the forward shapes, once each.
- bwd_dw        the seven weight gradients (sgemm on the dW worker): the forward shapes, once each.
- bwd_attn      dV = probsᵀ·da and dp = da·Vᵀ (sdpaBwd1, with the probabilities sdpaFwd saved, so
                nothing is recomputed), dQ = ds·K and dK = dsᵀ·Q (sdpaBwd2): four GEMMs of the
                attention shape.

With LoRA (docs/lora.md) the kernels also run each adapter's two products forward and backward
(2·S·rank·(in + out) in fwd_proj and in bwd_dx), bwd_dw is the adapters' gradients alone (four
rank-sized products each, 4·S·rank·(in + out)) and the classifier has no dE: two GEMMs.
"""

from .lora import weight_shapes


def step_flops(cfg, n_active, lora=None):
    """FLOPs by part (ints) of one forward+backward micro-step of ONE sequence of cfg.seq tokens.

    `n_active` is the size of the compact (active) vocabulary the classifier runs over; `lora` a
    model.lora.Lora, or None for full training. Returns a dict with the parts listed in the module
    docstring, plus "total" (their sum).
    """
    s, d, h = cfg.seq, cfg.dim, cfg.hidden
    proj = [(d, cfg.q_dim), (d, cfg.kv_dim), (d, cfg.kv_dim), (cfg.q_dim, d),   # q, k, v, o
            (d, h), (d, h), (h, d)]                                              # w1, w3, w2
    proj_layer = sum(2 * s * i * o for i, o in proj)
    low = 2 * s * lora.rank * sum(sum(weight_shapes(cfg)[w]) for w in lora.targets) if lora else 0
    attn_gemm = cfg.heads * 2 * s * s * cfg.head_dim          # one [S, hd]×[hd, S]-sized product
    parts = {
        "fwd_proj": cfg.layers * (proj_layer + low),
        "fwd_attn": cfg.layers * 2 * attn_gemm,
        "classifier": (2 if lora else 3) * 2 * n_active * d * s,
        "bwd_dx": cfg.layers * (proj_layer + low),
        "bwd_dw": cfg.layers * (2 * low if lora else proj_layer),
        "bwd_attn": cfg.layers * 4 * attn_gemm,
    }
    parts["total"] = sum(parts.values())
    return parts
