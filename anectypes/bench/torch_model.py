"""The anectypes model in PyTorch, for `train --compare torch`; PyTorch is optional, imported only by the process
that times it. With LoRA the comparison is what a user would fine-tune with instead: the model as a Hugging Face
folder, loaded by transformers and wrapped by peft."""

import importlib.util
import warnings

from ..model.config import rope_tables
from ..model.lora import TARGETS

NO_TORCH = "anectypes does not depend on it: `pip install torch` to compare"


def import_torch():
    """(torch, None) or (None, why): PyTorch is optional, only --compare torch uses it."""
    try:
        import torch
    except ImportError as e:
        return None, f"PyTorch not installed ({e}); {NO_TORCH}"
    return torch, None


def torch_missing():
    """Why PyTorch cannot be compared, or None. Checked without importing it: the processes that
    run the benchmarks start as forks of this one, and Linux keeps a process's peak RSS across exec,
    so PyTorch imported here would count in every child's peak."""
    return f"PyTorch not installed; {NO_TORCH}" if importlib.util.find_spec("torch") is None else None


def torch_loss(torch, cfg, p, active, tokens, compact_targets, cos, sin, mask, lora=None):
    """The anectypes model in PyTorch (positions on rows, [S, C]): RMSNorm, QK-norm (with qk_norm),
    interleaved-pair RoPE, causal GQA attention with the full S×S scores masked, α-scaled residuals,
    SiLU-gated FFN, tied embedding (or the untied classifier) over the compact vocabulary (the embedding
    itself, no gathered copy, when every token is active, as in the simulator), mean cross-entropy.
    `p` maps anectypes' parameter names to tensors stored [out, in] like the simulator's; with `lora` (a
    model.lora.Lora) also the adapters, added to their projections as peft's Linear adds them."""
    F, a, hd = torch.nn.functional, cfg.alpha, cfg.head_dim

    def proj(x, name):
        y = x @ p[name].T
        if name + ".lora_a" in p:
            y = y + lora.scale * ((x @ p[name + ".lora_a"].T) @ p[name + ".lora_b"].T)
        return y

    def rms(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    def rope(t, heads):                               # [S, heads·hd] → [heads, S, hd]
        pairs = t.view(cfg.seq, heads, hd // 2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        rot = torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1)
        return rot.view(cfg.seq, heads, hd).transpose(0, 1)

    def head_norm(t, heads, w):                       # QK-norm: each head over its hd
        return rms(t.view(cfg.seq, heads, hd), w).view(cfg.seq, heads * hd) if cfg.qk_norm else t

    x = p["embed"][tokens]
    for i in range(cfg.layers):
        L = f"layers.{i}."
        xn = rms(x, p[L + "rms_att"])
        q = rope(head_norm(proj(xn, L + "wq"), cfg.heads, p.get(L + "q_norm")), cfg.heads)
        k = rope(head_norm(proj(xn, L + "wk"), cfg.kv_heads, p.get(L + "k_norm")), cfg.kv_heads)
        k = k.repeat_interleave(cfg.gqa_ratio, 0)
        v = proj(xn, L + "wv").view(cfg.seq, cfg.kv_heads, hd).transpose(0, 1).repeat_interleave(cfg.gqa_ratio, 0)
        probs = torch.softmax(q @ k.transpose(1, 2) * (hd ** -0.5) + mask, -1)
        attn = (probs @ v).transpose(0, 1).reshape(cfg.seq, cfg.q_dim)
        x2 = x + a * proj(attn, L + "wo")
        x2n = rms(x2, p[L + "rms_ffn"])
        x = x2 + a * proj(F.silu(proj(x2n, L + "w1")) * proj(x2n, L + "w3"), L + "w2")
    cls = p["embed"] if cfg.tied else p["classifier"]
    out_w = cls if len(active) == cfg.vocab else cls[active]
    logits = rms(x, p["rms_final"]) @ out_w.T
    return F.cross_entropy(logits, compact_targets)


def torch_inputs(torch, cfg):
    """cos/sin [S, 1, hd/2] (one value per pair) and the additive causal mask [S, S]."""
    cos, sin = (torch.tensor(t.T[:, None, :], dtype=torch.float32) for t in rope_tables(cfg))   # llama3's too
    mask = torch.triu(torch.full((cfg.seq, cfg.seq), float("-inf")), diagonal=1)
    return cos, sin, mask


def peft_model(torch, folder, lora):
    """(the transformers model of a Hugging Face folder, fp32 with its default attention, wrapped by peft's LoRA on
    the same projections (peft's own initialization: A as ours is drawn, B zero), its versions)."""
    import peft
    import transformers
    transformers.logging.set_verbosity_error()          # the bench's output is its table
    transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    names = [f"{t}_proj" for t, w in TARGETS.items() if w in lora.targets]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # peft 0.21 calls a name transformers 5 deprecates
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=names,
                                                           lora_dropout=0.0))
    return model, (f"transformers {transformers.__version__} {type(model.base_model.model).__name__} + peft "
                   f"{peft.__version__}")


def peft_loss(torch, model, active, tokens, compact_targets):
    """The mean cross-entropy over the compact vocabulary (the whole of it: transformers' own lm_head) of a
    peft-wrapped causal LM, batch 1."""
    causal = model.base_model.model
    x = causal.model(input_ids=tokens[None]).last_hidden_state[0]
    logits = causal.lm_head(x) if active is None else x @ causal.lm_head.weight[active].T
    return torch.nn.functional.cross_entropy(logits, compact_targets)
